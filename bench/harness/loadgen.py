"""The load generator: spawned processes, each with threads, each thread one caller.

Closed loop (level = concurrency): every thread keeps one request in flight; latency from its
send. Open loop (level = requests/s): each process runs a Poisson arrival process of rate
level/procs; a dispatcher thread queues the *scheduled* send times and a pool of sender threads
takes them; latency counts from the scheduled time, so a server (or generator) that falls behind
shows up as latency, not as a lower offered load (no coordinated omission); `send_lag` shows when
the generator itself lags. All processes share one start time (CLOCK_MONOTONIC is system-wide);
only requests started or scheduled inside the window are recorded, and those still in flight at
its end are waited for.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import resource
import signal
import threading
import time
import traceback
from array import array
from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Optional

import numpy as np

from tgw.bench.harness.targets import error_code

READY_TIMEOUT = 60.0   # seconds for a generator process to start, connect and set up its threads
DRAIN_TIMEOUT = 60.0   # seconds after the window for the requests still in flight


@dataclass
class LoadSpec:
    mode: str = "closed"          # "closed" (level = concurrency) or "open" (level = requests/s)
    level: float = 1
    duration: float = 5.0
    warmup: float = 1.0
    procs: int = 0                # 0: half the cores (the server needs the rest), 2..4
    max_inflight: int = 256       # open loop: sender threads in all processes together
    seed: int = 1


def cpu_seconds(who: int = resource.RUSAGE_SELF) -> float:
    """CPU time of this process (or, with RUSAGE_CHILDREN, of its reaped children)."""
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


class _Recorder:
    """One thread's samples: latency and send lag of each success, failures by code."""

    def __init__(self) -> None:
        self.lat, self.lag = array("d"), array("d")
        self.errors: Counter = Counter()
        self.messages: dict[str, str] = {}


def _run_one(call: Callable[[], None], rec: _Recorder, t_ref: float, sent: float, ws: float, we: float) -> None:
    """One request; recorded only if its reference time (start or schedule) is inside [ws, we)."""
    try:
        call()
        exc = None
    except Exception as e:  # noqa: BLE001 - every failure is counted by code
        exc = e
    t1 = time.monotonic()
    if not (ws <= t_ref < we):
        return
    if exc is None:
        rec.lat.append(t1 - t_ref)
        rec.lag.append(sent - t_ref)
    else:
        code = error_code(exc)
        rec.errors[code] += 1
        rec.messages.setdefault(code, str(exc)[:300])


def _dispatch(q: "queue.SimpleQueue", rate: float, w: SimpleNamespace, nthreads: int, seed: int) -> None:
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=4096)
    t, i = w.start + gaps[0], 1
    while t < w.we:
        time.sleep(max(0.0, t - time.monotonic()))
        q.put(t)
        t, i = t + gaps[i % len(gaps)], i + 1
    for _ in range(nthreads):
        q.put(None)


def _thread(target: Any, index: int, rec: _Recorder, w: SimpleNamespace, q: Optional[queue.SimpleQueue],
            ready: threading.Barrier, go: threading.Event, failures: list) -> None:
    """The thread's caller is made in the thread (its socket, connection and handshake), so no
    measured request pays for connecting; then, from the common start, closed loop (q is None) or
    open loop (a send at each scheduled time taken from q)."""
    try:
        call = target.caller(index)
    except Exception:  # noqa: BLE001 - reported to the parent as a fatal start-up error
        failures.append(traceback.format_exc())
        ready.abort()
        return
    try:
        ready.wait()
    except threading.BrokenBarrierError:
        return
    go.wait()
    if q is None:
        while (t0 := time.monotonic()) < w.we:
            _run_one(call, rec, t0, t0, w.ws, w.we)
    else:
        while (t_sched := q.get()) is not None:
            _run_one(call, rec, t_sched, time.monotonic(), w.ws, w.we)


def _coroutines(target: Any, recs: list, w: SimpleNamespace, ready: threading.Barrier, go: threading.Event,
                failures: list) -> None:
    """A closed loop of `target.async_caller`s, one coroutine per caller, all on one asyncio loop in
    this thread: for asyncio clients (grpc.aio), whose per-call cost threads would only add to."""
    import asyncio

    async def main() -> None:
        calls = [await target.async_caller(i) for i in range(len(recs))]
        await asyncio.get_running_loop().run_in_executor(None, ready.wait)
        await asyncio.get_running_loop().run_in_executor(None, go.wait)

        async def loop(call, rec: _Recorder) -> None:
            while (t0 := time.monotonic()) < w.we:
                try:
                    await call()
                    exc = None
                except Exception as e:  # noqa: BLE001 - every failure is counted by code
                    exc = e
                if not (w.ws <= t0 < w.we):
                    continue
                if exc is None:
                    rec.lat.append(time.monotonic() - t0)
                    rec.lag.append(0.0)
                else:
                    rec.errors[error_code(exc)] += 1
                    rec.messages.setdefault(error_code(exc), str(exc)[:300])
        await asyncio.gather(*(loop(c, r) for c, r in zip(calls, recs)))
        if hasattr(target, "aclose"):
            await target.aclose()
    try:
        asyncio.run(main())
    except threading.BrokenBarrierError:
        return
    except Exception:  # noqa: BLE001 - reported to the parent as a fatal start-up error
        failures.append(traceback.format_exc())
        ready.abort()


def _child(index: int, target: Any, spec: LoadSpec, nthreads: int, rate: float, conn) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it stops us
    try:
        target = target.open(seed=spec.seed * 100 + index)
    except Exception:  # noqa: BLE001
        conn.send({"fatal": traceback.format_exc()})
        return
    w = SimpleNamespace(start=0.0, ws=0.0, we=0.0)
    recs = [_Recorder() for _ in range(nthreads)]
    q = None if spec.mode == "closed" else queue.SimpleQueue()
    ready, go, failures = threading.Barrier(nthreads + 1), threading.Event(), []
    if spec.mode == "closed" and hasattr(target, "async_caller"):   # one thread, a coroutine per caller
        ready = threading.Barrier(2)
        threads = [threading.Thread(target=_coroutines, args=(target, recs, w, ready, go, failures), daemon=True)]
    else:
        threads = [threading.Thread(target=_thread, args=(target, i, r, w, q, ready, go, failures), daemon=True)
                   for i, r in enumerate(recs)]
    for th in threads:
        th.start()
    try:
        ready.wait()
    except threading.BrokenBarrierError:
        conn.send({"fatal": failures[0] if failures else "a generator thread failed"})
        return
    conn.send({"ready": True})
    w.start = conn.recv()
    w.ws, w.we = w.start + spec.warmup, w.start + spec.warmup + spec.duration
    if spec.mode == "open":
        threads.append(threading.Thread(target=_dispatch, daemon=True,
                                        args=(q, rate, w, nthreads, spec.seed * 7919 + index)))
        threads[-1].start()
    time.sleep(max(0.0, w.start - time.monotonic()))
    go.set()
    cpu = []  # this process's CPU time at the window's edges
    for edge in (w.ws, w.we):
        time.sleep(max(0.0, edge - time.monotonic()))
        cpu.append(cpu_seconds())
    for th in threads:
        th.join()
    cat = lambda name: np.concatenate([np.frombuffer(getattr(r, name), dtype=np.float64) for r in recs])  # noqa: E731
    conn.send({"lat": cat("lat"), "lag": cat("lag"), "errors": sum((r.errors for r in recs), Counter()),
               "messages": {k: m for r in recs for k, m in r.messages.items()}, "cpu_s": cpu[1] - cpu[0],
               "threads": nthreads})
    try:
        target.close()
    except Exception:  # noqa: BLE001 - closing is best effort, the numbers are already sent
        pass


def reap(children: list) -> None:
    """Terminate the generator processes still alive (by PID: only the ones this run started)."""
    for p in children:
        if p.is_alive():
            p.terminate()
            p.join(5)


def receive(conn, proc, timeout: float, what: str) -> dict:
    """A generator process's next message ("ready", then its samples), or an error saying why not."""
    try:
        msg = conn.recv() if conn.poll(timeout) else None
    except EOFError:  # the process is gone
        msg = None
    if msg is None:
        proc.join(1)
        raise RuntimeError(f"load generator process {proc.pid} sent no {what} (exit status {proc.exitcode}, "
                           f"{timeout:g} s allowed): a stuck server, or a script that spawns children without "
                           f"`if __name__ == '__main__':`")
    if "fatal" in msg:
        raise RuntimeError(f"load generator process failed to start:\n{msg['fatal']}")
    return msg


def run_load(target: Any, spec: LoadSpec, on_window_start: Optional[Callable[[], None]] = None,
             on_window_end: Optional[Callable[[], None]] = None) -> dict:
    """Run one load level; returns the raw samples merged over processes (see measure.loadgen_drive)."""
    closed = spec.mode == "closed"
    procs = spec.procs or max(2, min(4, (os.cpu_count() or 1) // 2))
    procs = max(1, min(procs, int(spec.level))) if closed else procs  # never more processes than threads
    total = int(spec.level) if closed else max(spec.max_inflight, procs)
    threads = [total // procs + (1 if i < total % procs else 0) for i in range(procs)]
    ctx = mp.get_context("spawn")
    children, conns = [], []
    try:
        for i in range(procs):
            conn, child_conn = ctx.Pipe()
            children.append(ctx.Process(target=_child, name=f"tgw-bench-gen-{i}", daemon=True,
                                        args=(i, target, spec, threads[i], 0.0 if closed else spec.level / procs,
                                              child_conn)))
            children[-1].start()
            child_conn.close()  # the child holds the only copy, so its death reads as EOF here
            conns.append(conn)
        for c, p in zip(conns, children):
            receive(c, p, READY_TIMEOUT, "ready message")
        start = time.monotonic() + 0.1
        for c in conns:
            c.send(start)
        we = start + spec.warmup + spec.duration
        for edge, hook in ((start + spec.warmup, on_window_start), (we, on_window_end)):
            time.sleep(max(0.0, edge - time.monotonic()))
            if hook:
                hook()
        results = [receive(c, p, max(0.0, we + DRAIN_TIMEOUT - time.monotonic()), "results")
                   for c, p in zip(conns, children)]
        for p in children:
            p.join(10)
    finally:
        reap(children)
    return {"lat": np.concatenate([r["lat"] for r in results]), "lag": np.concatenate([r["lag"] for r in results]),
            "errors": dict(sum((r["errors"] for r in results), Counter())),
            "error_messages": {k: m for r in results for k, m in r["messages"].items()},
            "gen_cpu_s": [r["cpu_s"] for r in results], "gen_threads": threads, "procs": procs, "spec": spec}
