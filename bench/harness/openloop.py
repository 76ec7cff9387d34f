"""An open loop by priority (`tgw-bench overload`): spawned generator processes, each a Poisson
dispatcher feeding sender threads that each hold one client socket; every request's priority,
outcome code, latency from its scheduled time and send lag come back to the parent. Then those
answers by priority level (`summarise`), the targets of a priority mix under an SLO (`checks`:
priority 0 served, shed from the lowest levels, every request answered once) and their table.
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
from types import SimpleNamespace
from typing import Any, Optional

import numpy as np

from tgw.bench.harness.loadgen import cpu_seconds, reap, receive
from tgw.bench.harness.targets import TgwTarget, error_code, make_inputs
from tgw.client.client import REPLY_GRACE_S  # past a request's timeout, how long the client waits for the answer

MIX = (0.10, 0.30, 0.60)         # share of requests at priority 0, 1, 2
LEVELS = len(MIX)
CLIENT_TIMEOUT = "CLIENT_TIMEOUT"  # the client gave up waiting: DEADLINE_EXCEEDED, details.source == "client"
MAX_THREADS = 2048               # sender threads over all generator processes
READY_TIMEOUT = 120.0            # seconds for a generator process to connect all its threads
DRAIN_S = 60.0                   # seconds after the window for the last answers (and a backlog)
COLUMNS = ("OVERLOADED", "RATE_LIMITED", "DEADLINE_EXCEEDED", "CIRCUIT_OPEN")  # broker codes with a column
LAG_WARN_MS = 10.0               # a generator whose p99 send lag is over this fell behind


def classify(exc: BaseException) -> str:
    """A failure's code; the client's own give-up is CLIENT_TIMEOUT (the broker's has no source)."""
    code = error_code(exc)
    if code == "DEADLINE_EXCEEDED" and (getattr(exc, "details", None) or {}).get("source") == "client":
        return CLIENT_TIMEOUT
    return code


class _Rec:
    """One sender thread's requests: priority, outcome code, latency from the schedule, send lag;
    how many it handed to the client and how many came back."""

    def __init__(self) -> None:
        self.prio, self.lat, self.lag, self.code = array("B"), array("d"), array("d"), []
        self.sent = self.answered = 0


def _child(index: int, address: str, model: str, rate: float, duration: float, timeout: float,
           nthreads: int, seed: int, conn) -> None:
    """A generator process: nthreads senders, each with its own socket, fed scheduled
    (time, priority) pairs by one Poisson dispatcher at `rate` from the common start."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's; it stops us
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # two descriptors per zmq socket
        want = 4 * nthreads + 256
        if soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(hard, want),
                                                        hard))
        target = TgwTarget(address, model, timeout=timeout).open(seed=seed * 100 + index)
    except Exception:  # noqa: BLE001 - reported to the parent
        conn.send({"fatal": traceback.format_exc()})
        return
    messages, failures, recs = {}, [], [_Rec() for _ in range(nthreads)]
    q: queue.SimpleQueue = queue.SimpleQueue()
    ready = threading.Barrier(nthreads + 1)
    w = SimpleNamespace(start=0.0, end=0.0, scheduled=0)

    def sender(rec: _Rec, i: int) -> None:
        try:
            inputs = make_inputs(target.meta, 1, target.seed * 1000 + i)
            target.client.health()  # this thread's socket and handshake, before the window
            ready.wait(READY_TIMEOUT)
        except Exception:  # noqa: BLE001
            failures.append(traceback.format_exc())
            ready.abort()
            return
        infer = target.client.infer
        while (item := q.get()) is not None:
            t_sched, prio = item
            t_send = time.monotonic()
            rec.sent += 1
            try:
                infer(model, inputs, priority=prio, timeout=timeout)
                code = "ok"
            except Exception as exc:  # noqa: BLE001 - every answer is classified
                code = classify(exc)
                messages.setdefault(code, str(exc)[:300])
            rec.lat.append(time.monotonic() - t_sched)
            rec.lag.append(t_send - t_sched)
            rec.prio.append(prio)
            rec.code.append(code)
            rec.answered += 1

    def dispatch() -> None:
        rng, t, n = np.random.default_rng(seed * 7919 + index), w.start, 0
        while t < w.end:
            for gap, prio in zip(rng.exponential(1.0 / rate, 4096), rng.choice(LEVELS, 4096, p=MIX)):
                t += gap
                if t >= w.end:
                    break
                time.sleep(max(0.0, t - time.monotonic()))
                q.put((t, int(prio)))
                n += 1
        w.scheduled = n
        for _ in range(nthreads):
            q.put(None)

    threads = [threading.Thread(target=sender, args=(r, i), daemon=True) for i, r in enumerate(recs)]
    for th in threads:
        th.start()
    try:
        ready.wait(READY_TIMEOUT)
    except threading.BrokenBarrierError:
        conn.send({"fatal": failures[0] if failures else "generator threads did not connect in time"})
        os._exit(0)  # threads may still be connecting: do not wait for them
    conn.send({"ready": True})
    w.start = conn.recv()
    w.end = w.start + duration
    time.sleep(max(0.0, w.start - time.monotonic()))
    cpu0 = cpu_seconds()
    disp = threading.Thread(target=dispatch, daemon=True)
    disp.start()
    disp.join()
    deadline = time.monotonic() + timeout + REPLY_GRACE_S + DRAIN_S
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    stuck = sum(th.is_alive() for th in threads)
    n = [len(r.code) for r in recs]  # a stuck thread may still append: take what is there now
    cat = lambda k, dt: np.concatenate([np.frombuffer(getattr(r, k)[:m], dtype=dt) for r, m in zip(recs, n)])  # noqa
    conn.send({"prio": cat("prio", np.uint8), "lat": cat("lat", np.float64), "lag": cat("lag", np.float64),
               "code": np.array([c for r, m in zip(recs, n) for c in r.code[:m]], dtype=str),
               "scheduled": w.scheduled, "sent": sum(r.sent for r in recs), "answered": sum(r.answered for r in recs),
               "stuck_threads": stuck, "messages": dict(messages),
               "cpu_s": cpu_seconds() - cpu0, "threads": nthreads})
    if stuck:
        os._exit(0)  # a thread still inside infer() holds its socket: leave without closing
    target.close()


def drive(address: str, model: str, rate: float, duration: float, timeout: float, procs: int, threads: int,
          seed: int = 1) -> dict[str, Any]:
    """The open loop: `procs` spawned processes, `threads` senders in all, Poisson arrivals at
    `rate` in all for `duration` s. Returns every request's priority, outcome code, latency and
    send lag (seconds), and the counts scheduled / sent / answered."""
    ctx, children, conns = mp.get_context("spawn"), [], []
    per = [threads // procs + (1 if i < threads % procs else 0) for i in range(procs)]
    try:
        for i in range(procs):
            conn, child_conn = ctx.Pipe()
            children.append(ctx.Process(target=_child, name=f"tgw-bench-overload-{i}", daemon=True,
                                        args=(i, address, model, rate / procs, duration, timeout, per[i], seed,
                                              child_conn)))
            children[-1].start()
            child_conn.close()  # the child holds the only copy, so its death reads as EOF here
            conns.append(conn)
        for c, p in zip(conns, children):
            receive(c, p, READY_TIMEOUT + 30, "ready message")
        start = time.monotonic() + 0.2
        for c in conns:
            c.send(start)
        end = start + duration + timeout + REPLY_GRACE_S + DRAIN_S + 30
        results = [receive(c, p, max(0.0, end - time.monotonic()), "results") for c, p in zip(conns, children)]
        for p in children:
            p.join(10)
    finally:
        reap(children)
    out: dict[str, Any] = {k: np.concatenate([r[k] for r in results]) for k in ("prio", "code", "lat", "lag")}
    for k in ("scheduled", "sent", "answered", "stuck_threads"):
        out[k] = sum(r[k] for r in results)
    out["messages"] = {k: m for r in results for k, m in r["messages"].items()}
    out["generator"] = {"procs": procs, "threads": per, "cpu_cores_per_proc": [r["cpu_s"] / duration for r in results]}
    return out


# ---- the answers by priority level, the targets, the table -----------------------------

def _pct(x: np.ndarray, q: float) -> Optional[float]:
    return float(np.percentile(x, q)) if x.size else None


def level_row(codes: np.ndarray, lat_s: np.ndarray, priority: Any) -> dict[str, Any]:
    ok = codes == "ok"
    counts = Counter(codes.tolist())
    ms, n = lat_s[ok] * 1e3, int(codes.size)
    errors = {k: v for k, v in sorted(counts.items()) if k != "ok"}
    return {"priority": priority, "offered": n, "ok": int(ok.sum()), "success": ok.sum() / n if n else None,
            "latency_ms": {"p50": _pct(ms, 50), "p99": _pct(ms, 99), "max": float(ms.max()) if ms.size else None},
            "answer_ms_max": float(lat_s.max() * 1e3) if n else None, "errors": errors,
            **{c: counts.get(c, 0) for c in COLUMNS}, "client_timeouts": counts.get(CLIENT_TIMEOUT, 0),
            "other": {k: v for k, v in errors.items() if k not in COLUMNS and k != CLIENT_TIMEOUT}}


def summarise(raw: dict[str, Any], adaptive: bool, rate: float, duration: float) -> dict[str, Any]:
    prio, code, lat, lag = raw["prio"], raw["code"], raw["lat"], raw["lag"] * 1e3
    gen = raw["generator"]
    run = {"adaptive_concurrency": adaptive, "rate_rps": rate, "duration_s": duration,
           "scheduled": raw["scheduled"], "sent": raw["sent"], "answered": raw["answered"],
           "unanswered": raw["scheduled"] - raw["answered"], "stuck_threads": raw["stuck_threads"],
           "levels": [level_row(code[prio == p], lat[prio == p], p) for p in range(LEVELS)],
           "all": level_row(code, lat, "all"), "goodput_rps": int((code == "ok").sum()) / duration,
           "error_messages": raw["messages"],
           "send_lag_ms": {"p50": _pct(lag, 50), "p99": _pct(lag, 99), "max": float(lag.max()) if lag.size else None},
           "generator": {**gen, "cpu_cores": sum(gen["cpu_cores_per_proc"])}}
    w = []
    if (run["send_lag_ms"]["p99"] or 0) > LAG_WARN_MS:
        w.append(f"the generator fell behind: send lag p99 {run['send_lag_ms']['p99']:.1f} ms (latencies include it)")
    if any(c >= 0.9 for c in gen["cpu_cores_per_proc"]):
        w.append("a generator process used over 90 % of a core (GIL-bound): rerun with more --procs")
    if raw["scheduled"] < 0.9 * rate * duration:
        w.append(f"scheduled {raw['scheduled']} requests, {raw['scheduled'] / duration:,.0f}/s of {rate:,.0f}/s")
    run["warnings"] = w
    return run


def checks(run: dict[str, Any], slo_ms: float) -> list[dict[str, Any]]:
    """The issue's targets; `target` false marks the P0 checks of the run without the adaptive
    limit (printed for comparison). Answering every request once holds for both."""
    p0, on = run["levels"][0], run["adaptive_concurrency"]
    p99, succ = p0["latency_ms"]["p99"], p0["success"]
    rates = [lv["success"] for lv in run["levels"]]  # ordered within a point: noise is no failure
    ordered = None not in rates and all(a >= b - 0.01 for a, b in zip(rates, rates[1:]))
    fmt = lambda v, f: "-" if v is None else f.format(v)  # noqa: E731
    return [
        {"check": "priority 0 success >= 99 %", "pass": succ is not None and succ >= 0.99,
         "value": fmt(succ, "{:.2%}"), "target": on},
        {"check": f"priority 0 p99 <= SLO {slo_ms:g} ms", "pass": p99 is not None and p99 <= slo_ms,
         "value": fmt(p99, "{:.1f} ms"), "target": on},
        {"check": "shed from the lowest levels (success P0 >= P1 >= P2, within 1 point)", "pass": ordered,
         "value": " / ".join(fmt(r, "{:.1%}") for r in rates), "target": on},
        {"check": "no client-side timeouts", "pass": run["all"]["client_timeouts"] == 0,
         "value": str(run["all"]["client_timeouts"]), "target": True},
        {"check": "every request answered once (answered == sent)",
         "pass": run["answered"] == run["sent"] == run["scheduled"],
         "value": f"{run['answered']:,d} of {run['scheduled']:,d}", "target": True}]


def level_table(run: dict[str, Any]) -> list[list[str]]:
    f = lambda v, fmt="{:.1f}": "-" if v is None else fmt.format(v)  # noqa: E731
    rows = [["priority", "offered", "ok", "success", "p50 ms", "p99 ms", *COLUMNS, "client timeout", "other"]]
    for lv in [*run["levels"], run["all"]]:
        rows.append([str(lv["priority"]), f"{lv['offered']:,d}", f"{lv['ok']:,d}", f(lv["success"], "{:.2%}"),
                     f(lv["latency_ms"]["p50"]), f(lv["latency_ms"]["p99"]), *(f"{lv[c]:,d}" for c in COLUMNS),
                     f"{lv['client_timeouts']:,d}", f"{sum(lv['other'].values()):,d}"])
    return rows
