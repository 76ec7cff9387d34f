"""Where the CPU of one request goes: the broker (by thread, with perf, py-spy or cProfile) under
load, and the sync client's own cost per `infer` (bench/README.md quotes both).

    python -m tgw.bench.profile_broker broker --concurrency 64 --duration 15 [--transport]
        [--http json|binary] [--perf PATH] [--py-spy PATH] [--cprofile wall|cpu] [--out DIR]
    python -m tgw.bench.profile_broker client --threads 1,8 --rounds 5 [--client NAME=WHERE ...]

`broker` starts a broker with the comparison's config (the demo models, one cpu worker per core),
loads it through the load generator and reports, over the window, the broker's CPU per request
by thread (/proc/PID/task/*/stat; with --transport the echo broker's first, under the same load;
with --http through its KServe v2 HTTP face, the comparison's JSON or binary body, by the Python
HTTP generator),
perf's on-CPU split by thread and library, py-spy's split of the Python work by area and
cProfile's calls per request (the broker then runs under `_run-broker`, SIGUSR2 toggling it).
`client` runs each `--client` (a module name, or a folder holding a copy of client/) in turn
against one broker, `--rounds` alternations, THREADS threads calling `infer` in a closed loop,
and divides the process's CPU (libzmq's thread included) and the calling threads' own CPU by the
calls. Numbers only mean anything as ratios within one run.
"""
from __future__ import annotations

import argparse
import collections
import importlib
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Optional

import psutil

from tgw.bench import comparison
from tgw.broker.child import BrokerProc, Proc, stop_all
from tgw.bench.loadgen import LoadSpec
from tgw.bench.measure import loadgen_drive, measure
from tgw.bench.targets import TgwTarget, find_model, make_inputs, v2_body, v2_target

TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (thread name, user + system CPU seconds) of every thread of pid."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / TICK)  # utime, stime
    return out


# the broker's work by area: the first of these functions found in a sample's stack, innermost
# first, names its area (samples whose innermost frame is the event loop itself are counted apart)
AREAS = (
    ("reply: answer, outbox, send", ("FrontDoor.answer", "FrontDoor.reply", "FrontDoor.error", "Outbox.send")),
    ("completion: decode Done, rows", ("WorkerMessages.on_message",)),
    ("batching: pump, next_batch, stage, send", ("Broker.pump", "Broker.schedule")),
    ("intake: read, validate, admit, queue", ("FrontDoor.on_message",)),
    ("drain loop + recv_multipart", ("Pump.drain",)),
    ("gatekeeper thread (ZAP, monitor)", ("Gatekeeper.run",)),
    ("monitor, tick, stats", ("Lifecycle", "Broker.tick")),
)
ZMQ_CALLS = ("Socket.send", "Socket.recv", "Socket.recv_multipart", "Socket.get")


def read_stacks(path: str) -> dict[str, Any]:
    """py-spy's raw output ("func (file:line);... count" per line) -> own and inclusive samples per
    "func (dir/file)", samples per area, of which inside a pyzmq call (libzmq and its syscalls,
    the GIL released), samples in the event loop's own frame, and the total."""
    own, incl, per, in_zmq = (collections.Counter() for _ in range(4))
    loop = total = 0
    for line in open(path):
        stack, _, n = line.rstrip("\n").rpartition(" ")
        if not stack or not n.isdigit():
            continue
        n = int(n)
        frames = [re.sub(r"\(([^()]*?)(?::\d+)?\)$", lambda m: f"({'/'.join(m[1].split('/')[-2:])})", f)
                  for f in stack.split(";")]
        funcs = [f.split(" (")[0] for f in frames]
        total += n
        own[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
        if funcs[-1] == "Runner.run":
            loop += n
            continue
        area = next((name for name, fns in AREAS for f in reversed(funcs) if f.startswith(fns)), "other")
        per[area] += n
        if funcs[-1] in ZMQ_CALLS:
            in_zmq[area] += n
    return {"own": own, "incl": incl, "areas": per, "in_zmq": in_zmq, "loop": loop, "total": total}


class ProfiledBroker(BrokerProc):
    """The same broker started through `_run-broker PROFILE`, so SIGUSR2 toggles cProfile in it."""

    def start(self, wait: bool = True, timeout: float = 60.0, env: Optional[dict] = None) -> "ProfiledBroker":
        self.argv = [sys.executable, "-m", "tgw.bench.profile_broker", "_run-broker", self.profile_path,
                     "start", "--config", self.config_path, "--address", self.address]
        Proc.start(self, env)
        if wait:
            self.wait_ready(timeout)
        return self


def run_profiled_broker(profile_path: str, argv: list[str]) -> None:
    """tgw-broker ARGS; the first SIGUSR2 starts cProfile on the uvloop thread, the next stops it and
    writes PROFILE. Timer ($TGW_PROFILE_TIMER): wall, cProfile's own clock (less overhead), or cpu,
    time.thread_time (a system call per event)."""
    import cProfile
    prof = cProfile.Profile(time.thread_time) if os.environ.get("TGW_PROFILE_TIMER") == "cpu" else cProfile.Profile()
    on = []

    def toggle(signum, frame) -> None:  # runs on the main (uvloop) thread, between bytecodes
        if not on:
            on.append(prof.enable())
            return
        prof.disable()
        prof.dump_stats(profile_path + ".tmp")
        os.replace(profile_path + ".tmp", profile_path)
        on.clear()
    signal.signal(signal.SIGUSR2, toggle)
    from tgw.broker.cli import main as broker_main
    broker_main(argv)


def start_broker(work: str, workers: int, profile_path: Optional[str] = None) -> BrokerProc:
    cfg = comparison.tgw_config(comparison.demo_models(os.path.join(work, "models")), ["mlp", "resnet", "resnet224"],
                                workers)
    srv = ProfiledBroker(cfg, work) if profile_path else BrokerProc(cfg, work)
    srv.profile_path = profile_path
    return srv.start(timeout=180)


def cprofile_report(path: str, n: int, main_us: float, top: int) -> None:
    """The top functions of a cProfile dump by own time: % of the profiled time, µs per request
    (that share of the unprofiled main thread's CPU) and calls per request."""
    import pstats
    st = pstats.Stats(path).stats  # (file, line, name) -> (primitive calls, calls, tottime, cumtime, callers)
    total = sum(v[2] for v in st.values())
    print(f"\ncProfile (uvloop thread; {path}): {total / n * 1e6:.1f} us/request profiled (the "
          f"profiler's own cost inflates it) vs {main_us:.1f} unprofiled; us/request = share x {main_us:.1f}")

    def name(k) -> str:
        f, line, fn = k
        return fn if f == "~" else f"{fn} ({'/'.join(f.split('/')[-2:])}:{line})"
    for title, idx in (("own time", 2), ("inclusive time", 3)):
        print(f"top {top} by {title}:   share   us/req  calls/req")
        for k, v in sorted(st.items(), key=lambda kv: -kv[1][idx])[:top]:
            print(f"  {v[idx] / total:6.1%} {v[idx] / total * main_us:7.1f}  {v[1] / n:8.2f}  {name(k)}")


def per_thread_us(a0: dict, a1: dict, n: int, main_tid: int) -> list[tuple[str, float]]:
    """(thread, CPU µs per request) between two thread_cpu() readings, busiest first."""
    rows = [(f"{name} (tid {tid}{', main' if tid == main_tid else ''})", (cpu - a0.get(tid, ("", 0.0))[1]) / n * 1e6)
            for tid, (name, cpu) in a1.items()]
    return sorted((r for r in rows if r[1] > 0), key=lambda r: -r[1])


def window(a: argparse.Namespace, target, processes: list, pid: int, at_start=(), at_end=(), stats=None):
    """measure() one closed-loop level; the thread CPU of `pid` and the hooks at the window's edges."""
    edges: list[dict] = []

    def drive(target, spec, on_window_start, on_window_end):
        start = lambda: [on_window_start(), edges.append(thread_cpu(pid)), *(h(spec) for h in at_start)]  # noqa: E731
        end = lambda: [edges.append(thread_cpu(pid)), *(h() for h in at_end), on_window_end()]  # noqa: E731
        return loadgen_drive(target, spec, on_window_start=start, on_window_end=end)
    row = measure(target, LoadSpec("closed", a.concurrency, a.duration, a.warmup, a.procs), processes, stats=stats,
                  drive=drive)
    n = row["requests_ok"] + row["requests_failed"]
    us = row["cpu_us_per_request"]
    print(f"{target.label} {a.model} c={a.concurrency}: {row['throughput_rps']:,.0f} req/s, p50 "
          f"{row['latency_ms']['p50']:.3f} ms, p99 {row['latency_ms']['p99']:.3f} ms, {n:,d} requests"
          + (f", mean batch {row['broker_stats']['mean_batch_rows'] or 0:.1f} rows" if stats else "")
          + f"\nCPU us/request: broker {us['broker']:.1f}, workers {us['workers']:.1f}, generator "
          f"{us['generator']:.1f}; server tree PSS {row['server_pss_mb']} MiB\nbroker threads, CPU us/request:")
    for name, v in per_thread_us(*edges, n, pid):
        print(f"  {v:8.1f}  {name}")
    return row, n, (edges[1][pid][1] - edges[0][pid][1]) / n * 1e6


def profile_broker(a: argparse.Namespace) -> int:
    from tgw.bench.baselines import EchoServer
    from tgw.bench.targets import ZmqEchoTarget, tensor_bytes
    from tgw.client import Client
    work = tempfile.mkdtemp(prefix="tgwp-", dir="/tmp")
    out = a.out or tempfile.mkdtemp(prefix="tgwp-out-", dir="/tmp")  # kept: the profiles are read after
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, f"broker-{a.model}-c{a.concurrency}")
    raw, perf_data, prof_path = stem + ".pyspy.txt", stem + ".perf.data", stem + ".cprofile" if a.cprofile else None
    if a.transport:
        m = comparison.demo_models(os.path.join(work, "models"))[a.model]
        echo = EchoServer(work)
        try:
            window(a, ZmqEchoTarget(echo.front, tensor_bytes(m["inputs"]), tensor_bytes(m["outputs"])),
                   echo.processes, echo.broker.pid)
        finally:
            echo.stop()
        print()
    os.environ["TGW_PROFILE_TIMER"] = a.cprofile or ""  # the profiled broker reads it
    srv, spies = start_broker(work, a.workers, prof_path), []
    try:
        with Client(srv.address) as c:
            processes = c.stats()["processes"]
            pid = next(p["pid"] for p in processes if p["role"] == "broker")
            toggle = [lambda *_: os.kill(pid, signal.SIGUSR2)] if prof_path else []
            argvs = ([[a.perf, "record", "-e", "cpu-clock", "-F", str(a.perf_rate), "-g", "-p", str(pid), "-o",
                       perf_data, "--", "sleep", str(a.duration)]] if a.perf else []) + \
                ([[a.py_spy, "record", "--pid", str(pid), "--duration", str(int(a.duration)), "--rate", str(a.rate),
                   "--nonblocking", "--format", "raw", "--output", raw]] if a.py_spy else [])
            spy = [lambda _: spies.extend(subprocess.Popen(v, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                                          for v in argvs)]
            target = TgwTarget(srv.address, a.model, timeout=60.0)
            if a.http:
                body, header = v2_body(find_model(c.models(), a.model), a.http == "binary")
                with open(os.path.join(work, "body"), "wb") as f:
                    f.write(body)
                target = v2_target(c.status()["http"], a.model, f.name, header, a.http == "binary",
                                   f"tgw HTTP {a.http}")
            row, n, main_us = window(a, target, processes, pid, at_start=toggle + spy, at_end=toggle, stats=c.stats)
            for p in spies:
                err = p.communicate(timeout=120)[1]
                if p.returncode:
                    print(f"{p.args[0]} failed ({p.returncode}): {err.decode(errors='replace')[-800:]}")
    finally:
        code = srv.stop(timeout=30)
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"broker exit status {code}; profiles in {out}")
    python_us = report_perf(a, perf_data, row["cpu_us_per_request"]["broker"]) if a.perf else None
    if a.py_spy and os.path.exists(raw):
        report_pyspy(a, raw, python_us or main_us, python_us is not None)
    if prof_path:
        deadline = time.monotonic() + 30
        while not os.path.exists(prof_path) and time.monotonic() < deadline:
            time.sleep(0.1)
        cprofile_report(prof_path, n, main_us, a.top)
    return 0 if code == 0 and not row["requests_failed"] else 1


def report_perf(a: argparse.Namespace, data: str, total_us: float) -> Optional[float]:
    """perf's split by thread and library, and its top symbols; returns the µs per request of the
    Python threads' own work (the interpreter, libc, msgspec, lz4: not the kernel, libzmq, uvloop)."""
    python_us = None
    print(f"\nperf (on-CPU samples of every broker thread; {data}); us/request = share x the broker's "
          f"{total_us:.1f}")
    for title, keys in (("by thread and library", "comm,dso"), (f"top {a.top} symbols", "comm,dso,sym")):
        rep = subprocess.run([a.perf, "report", "-i", data, "--stdio", "--no-children", "-g", "none",
                              "--percent-limit", "0.3", "--sort", keys], capture_output=True, text=True)
        print(f"{title}:")
        for ln in [ln for ln in rep.stdout.splitlines() if ln.strip() and not ln.startswith("#")][:a.top]:
            pct, rest = float(ln.split("%")[0]), ln.split("%", 1)[1].split()
            print(f"  {pct:5.1f}% {pct / 100 * total_us:6.1f} us  {' '.join(rest)}")
            if keys == "comm,dso" and rest[0] == "tgw-broker" and not re.search(r"kernel|zmq|loop\.", rest[1]):
                python_us = (python_us or 0.0) + pct / 100 * total_us
    return python_us


def report_pyspy(a: argparse.Namespace, raw: str, scale: float, from_perf: bool) -> None:
    """The Python work by area (without the samples inside pyzmq calls and in the event loop's own
    frame: on a busy machine those count time spent runnable, waiting for a CPU), then the top
    functions by own and inclusive samples."""
    st = read_stacks(raw)
    work = {k: v - st["in_zmq"][k] for k, v in st["areas"].items()}
    busy = sum(work.values()) or 1
    print(f"\npy-spy: the Python work by area ({busy:,d} samples; left out {sum(st['in_zmq'].values()):,d} inside "
          f"pyzmq calls, {st['loop']:,d} in the event loop's frame); us/request = share x "
          + (f"perf's Python work, {scale:.1f}" if from_perf else f"the main thread's CPU, {scale:.1f} (no --perf)"))
    for name, k in sorted(work.items(), key=lambda kv: -kv[1]):
        print(f"  {k / busy:6.1%} {k / busy * scale:7.1f} us  {name}")
    for title in ("own", "incl"):
        print(f"top {a.top} by {title} samples (of {st['total']:,d}; {raw}):")
        for frame, k in st[title].most_common(a.top):
            print(f"  {k / st['total']:6.1%}  {frame}")


# ---- the client's own cost ---------------------------------------------------------------------

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


def profile_client(a: argparse.Namespace) -> int:
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


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_run-broker"]:
        run_profiled_broker(argv[1], argv[2:])
        return 0
    ap = argparse.ArgumentParser(prog="python -m tgw.bench.profile_broker", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    b = sub.add_parser("broker", help="the broker's CPU per request by thread, and where it goes")
    c = sub.add_parser("client", help="the sync client's own CPU per infer")
    add = b.add_argument
    add("--concurrency", type=int, default=64)
    add("--procs", type=int, default=0, help="generator processes (default: as tgw-bench)")
    add("--transport", action="store_true", help="first the echo broker under the same load")
    add("--http", choices=("json", "binary"), help="load the broker through its HTTP face (KServe v2 JSON or "
                                                  "binary body) instead of the tgw client")
    add("--perf", help="path of perf: the broker's on-CPU samples (native frames, kernel)")
    add("--perf-rate", type=int, default=999, help="perf samples per second (default 999)")
    add("--py-spy", help="path of py-spy: the broker's Python stacks")
    add("--rate", type=int, default=200, help="py-spy samples per second (default 200)")
    add("--cprofile", choices=("wall", "cpu"), help="cProfile the uvloop thread (timer: cProfile's clock or "
                                                    "the thread's CPU time): calls per request")
    add("--top", type=int, default=25)
    add("--out", help="folder for the profiles (default: a new /tmp/tgwp-out-* folder)")
    add("--keep", action="store_true", help="keep the work folder (models, config, broker log)")
    c.add_argument("--threads", type=lambda t: [int(x) for x in t.split(",")], default=[1])
    c.add_argument("--client", action="append", metavar="NAME=WHERE",
                   help="a Client: module name or folder with a copy of client/ (repeatable; default tgw.client)")
    c.add_argument("--rounds", type=int, default=3)
    c.add_argument("--address", help="an already running broker (default: start one here)")
    for p in (b, c):
        p.add_argument("--model", default="mlp")
        p.add_argument("--duration", type=float, default=10.0)
        p.add_argument("--warmup", type=float, default=2.0)
        p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="cpu workers (default: cores)")
    a = ap.parse_args(argv)
    try:
        return profile_broker(a) if a.what == "broker" else profile_client(a)
    finally:
        stop_all()


if __name__ == "__main__":
    sys.exit(main())
