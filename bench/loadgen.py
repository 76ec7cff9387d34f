"""The load generator: several spawned processes, each with threads, each thread one caller.

Closed loop (`mode="closed"`, level = concurrency): every thread keeps one request in flight;
latency is measured from the moment it sends.

Open loop (`mode="open"`, level = requests/s): each process runs a Poisson arrival process of
rate level/procs (the superposition is Poisson of the full rate). A dispatcher thread queues the
*scheduled* send times; a pool of sender threads takes them. Latency is measured from the
scheduled time, so when the server (or the generator) falls behind, the queueing shows up as
latency instead of silently lowering the offered load (no coordinated omission). The gap between
scheduled and actual send (`send_lag`) is reported to show when the generator itself lags.

All processes share one start time (CLOCK_MONOTONIC is system-wide on Linux). Requests started
(closed) or scheduled (open) during the warm-up are not recorded; recording stops at the end of
the window, and requests still in flight then are waited for and counted.
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
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from tgw.bench.summary import merge
from tgw.bench.targets import error_code


@dataclass
class LoadSpec:
    mode: str = "closed"          # "closed" (level = concurrency) or "open" (level = requests/s)
    level: float = 1
    duration: float = 5.0
    warmup: float = 1.0
    procs: int = 0                # 0: default_procs()
    max_inflight: int = 256       # open loop: sender threads in all processes together
    seed: int = 1


def default_procs(spec: LoadSpec) -> int:
    """Half the cores (the server needs the rest), at least 2, at most 4, never more than threads."""
    cores = os.cpu_count() or 1
    n = max(2, min(4, cores // 2))
    if spec.mode == "closed":
        n = min(n, int(spec.level))
    return max(1, n)


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


class _Recorder:
    """Per-thread samples: start (closed) or scheduled (open) time, latency, send lag."""

    def __init__(self) -> None:
        self.t, self.lat, self.lag = array("d"), array("d"), array("d")
        self.errors: dict[str, int] = {}
        self.messages: dict[str, str] = {}
        self.done = 0


def _run_one(call: Callable[[], None], rec: _Recorder, t_ref: float, sent: float, ws: float, we: float) -> None:
    try:
        call()
        ok, exc = True, None
    except Exception as e:  # noqa: BLE001 - every failure is counted by code
        ok, exc = False, e
    t1 = time.monotonic()
    rec.done += 1
    if not (ws <= t_ref < we):
        return
    if ok:
        rec.t.append(t_ref)
        rec.lat.append(t1 - t_ref)
        rec.lag.append(sent - t_ref)
    else:
        code = error_code(exc)
        rec.errors[code] = rec.errors.get(code, 0) + 1
        rec.messages.setdefault(code, str(exc)[:300])


class _Window:
    """Start and window times, published to the threads when `go` is set."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.start = self.ws = self.we = 0.0


def _closed_thread(call, rec, w: _Window) -> None:
    while True:
        t0 = time.monotonic()
        if t0 >= w.we:
            return
        _run_one(call, rec, t0, t0, w.ws, w.we)


def _open_dispatch(q: "queue.SimpleQueue", rate: float, w: _Window, nthreads: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=4096)
    t, i = w.start, 0
    while True:
        t += gaps[i]
        i = (i + 1) % len(gaps)
        if t >= w.we:
            break
        delay = t - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        q.put(t)
    for _ in range(nthreads):
        q.put(None)


def _open_thread(call, rec, w: _Window, q) -> None:
    while True:
        t_sched = q.get()
        if t_sched is None:
            return
        _run_one(call, rec, t_sched, time.monotonic(), w.ws, w.we)


def _thread_main(init, body, args, w: _Window, barrier: threading.Barrier, failures: list) -> None:
    """Per-thread set-up first (e.g. the tgw client's per-thread socket and handshake), so no
    measured request pays for connecting; then wait for the common start."""
    try:
        if init is not None:
            init()
    except Exception:  # noqa: BLE001 - reported to the parent as a fatal start-up error
        failures.append(traceback.format_exc())
    barrier.wait()
    w.go.wait()
    if not failures:
        body(*args)


def _child(index: int, target: Any, spec: LoadSpec, nthreads: int, rate: float, conn, progress) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it stops us
    try:
        session = target.open(seed=spec.seed * 100 + index)
        callers = [session.caller(i) for i in range(nthreads)]
    except Exception:  # noqa: BLE001
        conn.send({"fatal": traceback.format_exc()})
        return
    init = getattr(session, "thread_init", None)
    w, barrier, failures = _Window(), threading.Barrier(nthreads + 1), []
    recs = [_Recorder() for _ in range(nthreads)]
    if spec.mode == "closed":
        bodies = [(_closed_thread, (c, r, w)) for c, r in zip(callers, recs)]
    else:
        q: queue.SimpleQueue = queue.SimpleQueue()
        bodies = [(_open_thread, (c, r, w, q)) for c, r in zip(callers, recs)]
    threads = [threading.Thread(target=_thread_main, args=(init, body, args, w, barrier, failures), daemon=True)
               for body, args in bodies]
    for th in threads:
        th.start()
    barrier.wait()
    if failures:
        w.go.set()
        conn.send({"fatal": failures[0]})
        return
    conn.send({"ready": True})
    w.start = conn.recv()
    w.ws, w.we = w.start + spec.warmup, w.start + spec.warmup + spec.duration
    ws, we = w.ws, w.we
    if spec.mode == "open":
        threads.append(threading.Thread(target=_open_dispatch, daemon=True,
                                        args=(q, rate, w, nthreads, spec.seed * 7919 + index)))
        threads[-1].start()
    time.sleep(max(0.0, w.start - time.monotonic()))
    w.go.set()
    cpu0 = cpu1 = None
    while any(th.is_alive() for th in threads):
        now = time.monotonic()
        if cpu0 is None and now >= ws:
            cpu0 = _cpu_seconds()
        if cpu1 is None and now >= we:
            cpu1 = _cpu_seconds()
        progress[index] = sum(r.done for r in recs)
        time.sleep(0.05 if cpu0 is None or cpu1 is None else 0.2)
    cpu1 = _cpu_seconds() if cpu1 is None else cpu1
    cpu0 = cpu1 if cpu0 is None else cpu0
    errors: dict[str, int] = {}
    messages: dict[str, str] = {}
    for r in recs:
        for k, v in r.errors.items():
            errors[k] = errors.get(k, 0) + v
        messages.update(r.messages)
    cat = lambda name: np.concatenate([np.frombuffer(getattr(r, name), dtype=np.float64) for r in recs])  # noqa: E731
    conn.send({"t": cat("t"), "lat": cat("lat"), "lag": cat("lag"), "errors": errors,
               "messages": messages, "cpu_s": cpu1 - cpu0, "threads": nthreads, "pid": os.getpid()})
    try:
        session.close()
    except Exception:  # noqa: BLE001 - closing is best effort, the numbers are already sent
        pass


def run_load(target: Any, spec: LoadSpec, on_window_start: Optional[Callable[[], None]] = None,
             on_window_end: Optional[Callable[[], None]] = None,
             on_tick: Optional[Callable[[float, int], None]] = None, ready_timeout: float = 60.0,
             drain_timeout: float = 60.0) -> dict:
    """Run one load level; returns raw samples merged over processes (see summarize())."""
    procs = spec.procs or default_procs(spec)
    if spec.mode == "closed":
        threads = _split(int(spec.level), procs)
        rates = [0.0] * procs
    elif spec.mode == "open":
        threads = _split(max(spec.max_inflight, procs), procs)
        rates = [spec.level / procs] * procs
    else:
        raise ValueError(f"mode must be closed or open, got {spec.mode!r}")
    ctx = mp.get_context("spawn")
    progress = ctx.RawArray("q", procs)
    children, conns = [], []
    try:
        for i in range(procs):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_child, args=(i, target, spec, threads[i], rates[i], child, progress),
                            name=f"tgw-bench-gen-{i}", daemon=True)
            p.start()
            children.append(p)
            conns.append(parent)
        for c, p in zip(conns, children):
            deadline = time.monotonic() + ready_timeout
            while not c.poll(0.1):
                if not p.is_alive():
                    raise RuntimeError(f"load generator process {p.pid} exited with status {p.exitcode} "
                                       f"before it was ready (spawned children re-import __main__: "
                                       f"guard the caller with `if __name__ == '__main__':`)")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"load generator process did not start within {ready_timeout}s")
            msg = c.recv()
            if "fatal" in msg:
                raise RuntimeError(f"load generator process failed to connect:\n{msg['fatal']}")
        start = time.monotonic() + 0.1
        for c in conns:
            c.send(start)
        ws, we = start + spec.warmup, start + spec.warmup + spec.duration
        window_started = window_ended = False
        while True:
            now = time.monotonic()
            if not window_started and now >= ws:
                window_started = True
                if on_window_start:
                    on_window_start()
            if window_started and not window_ended and now >= we:
                window_ended = True
                if on_window_end:
                    on_window_end()
            if on_tick:
                on_tick(now - start, int(sum(progress)))
            if now >= we and all(c.poll() for c in conns):
                break
            if now >= we + drain_timeout:
                raise RuntimeError(f"requests still in flight {drain_timeout:g}s after the window ended "
                                   f"(server stuck?); generator processes stopped")
            nxt = ws if not window_started else (we if not window_ended else now + 0.1)
            time.sleep(min(0.1, max(0.001, nxt - now)))
        results = []
        for c, p in zip(conns, children):
            try:
                results.append(c.recv())
            except EOFError:
                p.join(5)
                raise RuntimeError(f"load generator process {p.pid} died (exit status {p.exitcode})") from None
        for p in children:
            p.join(10)
    finally:
        for p in children:
            if p.is_alive():
                p.terminate()  # by PID, only the processes this run started
                p.join(5)
    return merge(results, spec, procs)
