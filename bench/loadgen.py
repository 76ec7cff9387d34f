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
from types import SimpleNamespace
from typing import Any, Callable, Optional

import numpy as np

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
    n = max(2, min(4, (os.cpu_count() or 1) // 2))
    return max(1, min(n, int(spec.level)) if spec.mode == "closed" else n)


def cpu_seconds(who: int = resource.RUSAGE_SELF) -> float:
    """CPU time of this process (or, with RUSAGE_CHILDREN, of its reaped children)."""
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


class _Recorder:
    """Per-thread samples: latency and send lag of each success, failures by code."""

    def __init__(self) -> None:
        self.lat, self.lag = array("d"), array("d")
        self.errors: dict[str, int] = {}
        self.messages: dict[str, str] = {}
        self.done = 0


def _run_one(call: Callable[[], None], rec: _Recorder, t_ref: float, sent: float, ws: float, we: float) -> None:
    """One request; recorded only if its reference time (start or schedule) is inside [ws, we)."""
    try:
        call()
        exc = None
    except Exception as e:  # noqa: BLE001 - every failure is counted by code
        exc = e
    t1 = time.monotonic()
    rec.done += 1
    if not (ws <= t_ref < we):
        return
    if exc is None:
        rec.lat.append(t1 - t_ref)
        rec.lag.append(sent - t_ref)
    else:
        code = error_code(exc)
        rec.errors[code] = rec.errors.get(code, 0) + 1
        rec.messages.setdefault(code, str(exc)[:300])


def _closed(call, rec: _Recorder, w: SimpleNamespace) -> None:
    while (t0 := time.monotonic()) < w.we:
        _run_one(call, rec, t0, t0, w.ws, w.we)


def _open(call, rec: _Recorder, w: SimpleNamespace, q: "queue.SimpleQueue") -> None:
    while (t_sched := q.get()) is not None:
        _run_one(call, rec, t_sched, time.monotonic(), w.ws, w.we)


def _dispatch(q: "queue.SimpleQueue", rate: float, w: SimpleNamespace, nthreads: int, seed: int) -> None:
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=4096)
    t, i = w.start + gaps[0], 1
    while t < w.we:
        time.sleep(max(0.0, t - time.monotonic()))
        q.put(t)
        t, i = t + gaps[i % len(gaps)], i + 1
    for _ in range(nthreads):
        q.put(None)


def _thread(init, body, args, barrier: threading.Barrier, failures: list) -> None:
    """Per-thread set-up first (e.g. the tgw client's per-thread socket and handshake), so no
    measured request pays for connecting; then wait for the common start."""
    try:
        if init is not None:
            init()
    except Exception:  # noqa: BLE001 - reported to the parent as a fatal start-up error
        failures.append(traceback.format_exc())
        barrier.abort()
        return
    try:
        barrier.wait()  # every thread is set up
        barrier.wait()  # go: the window's times are published
    except threading.BrokenBarrierError:
        return
    body(*args)


def _child(index: int, target: Any, spec: LoadSpec, nthreads: int, rate: float, conn, progress) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it stops us
    try:
        target = target.open(seed=spec.seed * 100 + index)
        callers = [target.caller(i) for i in range(nthreads)]
    except Exception:  # noqa: BLE001
        conn.send({"fatal": traceback.format_exc()})
        return
    w = SimpleNamespace(start=0.0, ws=0.0, we=0.0)
    recs = [_Recorder() for _ in range(nthreads)]
    q: queue.SimpleQueue = queue.SimpleQueue()
    body, extra = (_closed, ()) if spec.mode == "closed" else (_open, (q,))
    barrier, failures = threading.Barrier(nthreads + 1), []
    threads = [threading.Thread(target=_thread, daemon=True, args=(getattr(target, "thread_init", None), body,
                                                                    (c, r, w, *extra), barrier, failures))
               for c, r in zip(callers, recs)]
    for th in threads:
        th.start()
    try:
        barrier.wait()
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
    barrier.wait()
    cpu: dict[str, float] = {}  # this process's CPU time at the window's edges
    while any(th.is_alive() for th in threads):
        now = time.monotonic()
        for edge in ("ws", "we"):
            if edge not in cpu and now >= getattr(w, edge):
                cpu[edge] = cpu_seconds()
        progress[index] = sum(r.done for r in recs)
        time.sleep(0.05 if len(cpu) < 2 else 0.2)
    end = cpu.get("we", cpu_seconds())
    cat = lambda name: np.concatenate([np.frombuffer(getattr(r, name), dtype=np.float64) for r in recs])  # noqa: E731
    conn.send({"lat": cat("lat"), "lag": cat("lag"), "errors": [r.errors for r in recs],
               "messages": [r.messages for r in recs], "cpu_s": end - cpu.get("ws", end), "threads": nthreads})
    try:
        target.close()
    except Exception:  # noqa: BLE001 - closing is best effort, the numbers are already sent
        pass


def _merge(results: list[dict], spec: LoadSpec, procs: int) -> dict:
    errors: dict[str, int] = {}
    messages: dict[str, str] = {}
    for r in results:
        for e, m in zip(r["errors"], r["messages"]):
            for k, v in e.items():
                errors[k] = errors.get(k, 0) + v
            messages.update(m)
    return {"lat": np.concatenate([r["lat"] for r in results]), "lag": np.concatenate([r["lag"] for r in results]),
            "errors": errors, "error_messages": messages, "gen_cpu_s": [r["cpu_s"] for r in results],
            "gen_threads": [r["threads"] for r in results], "procs": procs, "spec": spec}


def run_load(target: Any, spec: LoadSpec, on_window_start: Optional[Callable[[], None]] = None,
             on_window_end: Optional[Callable[[], None]] = None,
             on_tick: Optional[Callable[[float, int], None]] = None, ready_timeout: float = 60.0,
             drain_timeout: float = 60.0) -> dict:
    """Run one load level; returns the raw samples merged over processes (see measure.summarize)."""
    if spec.mode not in ("closed", "open"):
        raise ValueError(f"mode must be closed or open, got {spec.mode!r}")
    procs = spec.procs or default_procs(spec)
    closed = spec.mode == "closed"
    threads = _split(int(spec.level) if closed else max(spec.max_inflight, procs), procs)
    rate = 0.0 if closed else spec.level / procs
    ctx = mp.get_context("spawn")
    progress = ctx.RawArray("q", procs)
    children, conns = [], []
    try:
        for i in range(procs):
            parent, child = ctx.Pipe()
            children.append(ctx.Process(target=_child, args=(i, target, spec, threads[i], rate, child, progress),
                                        name=f"tgw-bench-gen-{i}", daemon=True))
            children[-1].start()
            conns.append(parent)
        for c, p in zip(conns, children):
            deadline = time.monotonic() + ready_timeout
            while not c.poll(0.1):
                if not p.is_alive():
                    raise RuntimeError(f"load generator process {p.pid} exited with status {p.exitcode} before it "
                                       f"was ready (spawned children re-import __main__: guard the caller with "
                                       f"`if __name__ == '__main__':`)")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"load generator process did not start within {ready_timeout}s")
            msg = c.recv()
            if "fatal" in msg:
                raise RuntimeError(f"load generator process failed to connect:\n{msg['fatal']}")
        start = time.monotonic() + 0.1
        for c in conns:
            c.send(start)
        ws, we = start + spec.warmup, start + spec.warmup + spec.duration
        hooks = [(ws, on_window_start), (we, on_window_end)]  # called once each, in order
        while True:
            now = time.monotonic()
            while hooks and now >= hooks[0][0]:
                fn = hooks.pop(0)[1]
                if fn:
                    fn()
            if on_tick:
                on_tick(now - start, int(sum(progress)))
            if not hooks and all(c.poll() for c in conns):
                break
            if now >= we + drain_timeout:
                raise RuntimeError(f"requests still in flight {drain_timeout:g}s after the window ended "
                                   f"(server stuck?); generator processes stopped")
            time.sleep(min(0.1, max(0.001, hooks[0][0] - now)) if hooks else 0.1)
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
    return _merge(results, spec, procs)
