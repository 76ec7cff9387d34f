"""The sync client's own CPU per `infer` (`python -m tgw.bench.profile_broker client`): each
`--client` (a module name, or a folder holding a copy of client/) in turn against one broker,
`--rounds` alternations, THREADS threads calling `infer` in a closed loop; the process's CPU
(libzmq's thread included) and the calling threads' own CPU divided by the calls."""
from __future__ import annotations

import argparse
import collections
import importlib
import importlib.util
import os
import re
import shutil
import sys
import tempfile
import threading
import time

import psutil

from tgw.bench.targets import find_model, make_inputs


def load_client(where: str):
    """The Client class from a module name (tgw.client) or from a folder with a copy of client/."""
    if not os.path.isdir(where):
        return importlib.import_module(where).Client
    name = "tgw_client_" + re.sub(r"\W", "_", os.path.abspath(where))
    spec = importlib.util.spec_from_file_location(name, os.path.join(where, "__init__.py"),
                                                  submodule_search_locations=[where])
    sys.modules[name] = mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.Client


def client_round(cls, address: str, model: str, threads: int, duration: float, warmup: float) -> dict[str, float]:
    """threads x closed-loop infer for warmup + duration; CPU per call over the window (the
    process's includes this sleeping thread and the calls finishing after it: both negligible)."""
    client, stop, on = cls(address), threading.Event(), threading.Event()
    go, counts, tcpu = threading.Barrier(threads + 1), [0] * threads, [0.0] * threads
    try:
        meta = find_model(client.models(), model)

        def run(i: int) -> None:
            x, infer, k = make_inputs(meta, 1, i), client.infer, 0
            client.health()  # the thread's socket
            go.wait()
            while not on.is_set():
                infer(model, x)
            t0 = time.thread_time()
            while not stop.is_set():
                infer(model, x)
                k += 1
            tcpu[i], counts[i] = time.thread_time() - t0, k
        ths = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(threads)]
        for t in ths:
            t.start()
        go.wait()
        time.sleep(warmup)
        proc = psutil.Process()
        c0, w0 = sum(proc.cpu_times()[:2]), time.monotonic()
        on.set()
        time.sleep(duration)
        c1, w1 = sum(proc.cpu_times()[:2]), time.monotonic()
        stop.set()
        for t in ths:
            t.join()
    finally:
        client.close()
    calls = sum(counts)
    return {"rps": calls / (w1 - w0), "process_us": (c1 - c0) / calls * 1e6, "threads_us": sum(tcpu) / calls * 1e6}


def profile_client(a: argparse.Namespace, start_broker) -> int:
    """`start_broker(work, workers)`: the broker the clients call, unless `a.address` names one."""
    classes = {name: load_client(where) for name, where in (c.split("=", 1) for c in a.client or ["new=tgw.client"])}
    work = None if a.address else tempfile.mkdtemp(prefix="tgwp-", dir="/tmp")
    srv = start_broker(work, a.workers) if work else None
    results: dict[tuple[str, int], list[dict]] = collections.defaultdict(list)
    try:
        for r in range(a.rounds):
            for threads in a.threads:
                for name, cls in classes.items():
                    res = client_round(cls, a.address or srv.address, a.model, threads, a.duration, a.warmup)
                    results[(name, threads)].append(res)
                    print(f"round {r + 1} threads {threads} {name}: {res['rps']:,.0f} calls/s, process CPU "
                          f"{res['process_us']:.1f} us/call, calling threads {res['threads_us']:.1f} us/call",
                          flush=True)
    finally:
        code = srv.stop(timeout=30) if srv else 0
        if work:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\nmedian over rounds (us of CPU per infer):\n{'client':<16} {'threads':>7} {'calls/s':>9} {'process':>9} "
          f"{'threads':>9}")
    for (name, threads), rs in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        med = {k: sorted(x[k] for x in rs)[len(rs) // 2] for k in rs[0]}
        print(f"{name:<16} {threads:>7} {med['rps']:>9,.0f} {med['process_us']:>9.1f} {med['threads_us']:>9.1f}")
    return code
