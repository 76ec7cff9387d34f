"""`tgw-bench overload`: a broker of its own under twice the load it can serve, by priority.

    tgw-bench overload                        # 60 s at 2x capacity, adaptive limit on, then off
    tgw-bench overload --quick                # 10 s each
    tgw-bench overload --only on --factor 3 --duration 30 --json out.json

Serves one demo model (--model, default resnet: compute-bound, so twice its capacity is within a
Python generator's reach on 2 cores; built at run time, nothing is downloaded) with
priority_levels 3, slo_p99_ms --slo-ms, adaptive_concurrency on (then, in a fresh broker, off),
max_batch_size --max-batch-size (16: a batch computes in about 10 ms here, so the batch a
priority-0 request waits for and its own fit well inside a 100 ms SLO) and max_queue 4096, so
the queue bound is not what sheds. In each broker a closed loop
(--capacity-concurrency callers, --capacity-seconds) warms the model and measures capacity;
then an open loop of Poisson arrivals at --factor x the first broker's capacity runs for
--duration seconds, each request's priority drawn from a seeded RNG (10/30/60 % for levels
0/1/2), each with --timeout. Latency counts from the scheduled send (no coordinated omission).
Every answer is classified: ok, the broker's codes (OVERLOADED, RATE_LIMITED, DEADLINE_EXCEEDED,
CIRCUIT_OPEN, others) and the client's own give-up (DEADLINE_EXCEEDED with details.source ==
"client"), which should never happen; every scheduled request must get exactly one answer.
Prints a table per priority level, the targets with PASS/FAIL and priority 0's p99 with and
without the adaptive limit; writes JSON (--json, default bench/results/overload-<date>.json).
Exit status 0 when the runs completed (a failed target is printed, not an error), 1 when a
request got no answer, 2 for usage, start-up or connection problems, 130 when interrupted.
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from typing import Any, Callable, Optional

from tgw.bench.harness import report
from tgw.bench.harness.loadgen import LoadSpec
from tgw.bench.harness.measure import measure
from tgw.bench.harness.openloop import (LEVELS, MAX_THREADS, MIX, REPLY_GRACE_S, checks, drive, level_table,
                                        summarise)
from tgw.bench.harness.targets import TgwTarget
from tgw.client import Client, TgwError
from tgw.shm.segment import list_segments
from tgw.testing.child import BrokerProc
from tgw.testing.demo import demo_models, tgw_config

NAME = "overload"
HELP = "2x capacity by priority, adaptive limit on and off (own broker)"
MODES = {"quick": {"duration": 10.0, "capacity_seconds": 3.0, "warmup": 1.0},
         "full": {"duration": 60.0, "capacity_seconds": 5.0, "warmup": 2.0}}


# ---- results ----------------------------------------------------------------------------


def comparison_line(runs: dict[str, dict]) -> Optional[str]:
    if not {"on", "off"} <= set(runs):
        return None
    on, off = (runs[k]["levels"][0] for k in ("on", "off"))
    a, b = on["latency_ms"]["p99"], off["latency_ms"]["p99"]
    f = lambda v: "-" if v is None else f"{v:.1f} ms"  # noqa: E731
    ratio = f" (without/with: {b / a:.1f}x)" if a and b else ""
    s = lambda v: "-" if v is None else f"{v:.2%}"  # noqa: E731
    return (f"priority 0 p99: {f(a)} with the adaptive limit, {f(b)} without{ratio}; "
            f"priority 0 success {s(on['success'])} vs {s(off['success'])}")


# ---- the run ----------------------------------------------------------------------------


def broker_config(models: dict, model: str, workers: int, slo_ms: float, adaptive: bool,
                  max_batch_size: Optional[int] = None) -> dict[str, Any]:
    cfg = tgw_config(models, [model], workers)
    cfg["models"][0].update(priority_levels=LEVELS, slo_p99_ms=float(slo_ms), adaptive_concurrency=adaptive,
                            max_queue=4096)
    if max_batch_size:
        cfg["models"][0]["max_batch_size"] = max_batch_size
    cfg["server"]["max_clients"] = MAX_THREADS + 64  # one connection per sender thread
    return cfg


def _answers(before: dict, after: dict, model: str) -> int:
    """Answers the broker counted for `model` between two stats() snapshots: replies + errors."""
    b, a = (s.get("models", {}).get(model, {}) for s in (before, after))
    errs = lambda m: sum((m.get("errors") or {}).values())  # noqa: E731
    return int(a.get("replies", 0)) - int(b.get("replies", 0)) + errs(a) - errs(b)


def one_run(a: argparse.Namespace, models: dict, mode: str, work: str, capacity: Optional[float],
            log: Callable[[str], None]) -> tuple[dict[str, Any], float]:
    os.makedirs(os.path.join(work, mode))
    cfg = broker_config(models, a.model, a.workers, a.slo_ms, mode == "on", a.max_batch_size)
    broker = BrokerProc(cfg, os.path.join(work, mode))
    log(f"adaptive limit {mode}: starting the broker ({a.model}, {a.workers} cpu worker(s))")
    try:
        broker.start(timeout=180)
        with Client(broker.address) as c:
            cap = measure(TgwTarget(broker.address, a.model),
                          LoadSpec("closed", a.capacity_concurrency, a.capacity_seconds, a.warmup, a.procs),
                          c.stats()["processes"], stats=c.stats)
            log(f"capacity: {cap['throughput_rps']:,.1f} req/s (closed loop, {a.capacity_concurrency} callers, "
                f"{a.capacity_seconds:g} s), {cap['requests_failed']} failed"
                + (f"; the open loop uses the first run's {capacity:,.1f}" if capacity else ""))
            capacity = capacity or cap["throughput_rps"]
            if not capacity:
                raise RuntimeError(f"no capacity measured: {cap['errors']} {cap.get('error_messages')}")
            rate = a.factor * capacity
            threads = a.max_inflight or min(MAX_THREADS, max(16, math.ceil(rate * (a.timeout + REPLY_GRACE_S) * 1.25)))
            procs = a.procs or max(2, min(4, (os.cpu_count() or 1) // 2))  # as loadgen.py
            log(f"open loop: {rate:,.1f} req/s ({a.factor:g}x capacity) for {a.duration:g} s, timeout {a.timeout:g} s, "
                f"{procs} generator process(es), {threads} sender threads")
            before = c.stats()
            raw = drive(broker.address, a.model, rate, a.duration, a.timeout, procs, max(threads, procs), a.seed)
            after = c.stats()
    finally:
        exit_status = broker.stop(timeout=30)
    run = summarise(raw, mode == "on", rate, a.duration)
    run.update(capacity_rps=cap["throughput_rps"], capacity_run={k: cap.get(k) for k in (
        "requests_ok", "requests_failed", "errors", "latency_ms", "throughput_rps")},
        broker_answers=_answers(before, after, a.model), broker_exit_status=exit_status,
        shm_leftovers=list_segments(broker.pid), config=cfg["models"][0])
    run["checks"] = checks(run, a.slo_ms)
    return run, capacity


def print_run(run: dict[str, Any], out: Callable[[str], None]) -> None:
    mode = "on" if run["adaptive_concurrency"] else "off"
    out(f"\nadaptive limit {mode}: {run['rate_rps']:,.1f} req/s offered for {run['duration_s']:g} s; "
        f"{run['scheduled']:,d} scheduled, {run['sent']:,d} sent, {run['answered']:,d} answered (the broker "
        f"counted {run['broker_answers']:,d}); goodput {run['goodput_rps']:,.1f} req/s; send lag p99 "
        f"{run['send_lag_ms']['p99'] or 0:.1f} ms; generator {run['generator']['cpu_cores']:.2f} cores")
    out(report.text_table(level_table(run), 1))
    others = Counter()
    for lv in run["levels"]:
        others.update(lv["other"])
    if others:
        out("other: " + ", ".join(f"{k} {v} ({run['error_messages'].get(k, '')[:120]})" for k, v in others.items()))
    for ch in run["checks"]:
        out(f"  {'PASS' if ch['pass'] else 'FAIL'}  {ch['check']}: {ch['value']}"
            + ("" if ch["target"] else "  (without the adaptive limit: for comparison, not a target)"))
    for w in run["warnings"]:
        out(f"  WARNING: {w}")
    if run["broker_exit_status"] != 0 or run["shm_leftovers"]:
        out(f"  broker stop: exit status {run['broker_exit_status']}, /dev/shm leftovers {run['shm_leftovers']}")


def run(a: argparse.Namespace, out: Callable[[str], None] = print) -> int:
    mode = "quick" if a.quick else "full"
    for k in ("duration", "capacity_seconds", "warmup"):
        if getattr(a, k) is None:
            setattr(a, k, MODES[mode][k])
    if min(a.duration, a.capacity_seconds, a.factor, a.timeout, a.slo_ms) <= 0 or a.warmup < 0 or a.workers < 1 \
            or a.capacity_concurrency < 1 or a.procs < 0 or (a.max_inflight or 0) < 0:
        print("tgw-bench overload: durations, --factor, --timeout and --slo-ms must be > 0, --warmup >= 0, "
              "--workers and --capacity-concurrency >= 1", file=sys.stderr)
        return 2
    log = lambda msg: out(f"[overload {time.strftime('%H:%M:%S')}] {msg}")  # noqa: E731
    work = tempfile.mkdtemp(prefix="tgwov-", dir="/tmp")  # ipc paths must stay under 107 bytes
    date, runs, capacity = datetime.datetime.now().strftime("%Y-%m-%d-%H%M%S"), {}, None
    try:
        models = demo_models(os.path.join(work, "models"))
        if a.model not in models:
            print(f"tgw-bench overload: unknown model {a.model!r}; choose from {', '.join(models)}", file=sys.stderr)
            return 2
        for m in ["on", "off"] if a.only is None else [a.only]:
            runs[m], capacity = one_run(a, models, m, work, capacity, log)
            print_run(runs[m], out)
    except (RuntimeError, TimeoutError, ConnectionError, LookupError, TgwError) as exc:
        print(f"tgw-bench overload: {exc}", file=sys.stderr)
        return 2
    finally:  # each run stopped its own broker (by PID) already
        shutil.rmtree(work, ignore_errors=True)
    line = comparison_line(runs)
    if line:
        out("\n" + line)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    dest = a.json or os.path.join("bench/results" if os.path.isfile("bench/cli.py") else
                                  os.path.join(here, "results") if os.path.isdir(os.path.join(here, "results"))
                                  else ".", f"overload-{date}.json")
    settings = {k: getattr(a, k) for k in ("model", "workers", "duration", "factor", "slo_ms", "timeout",
                                           "capacity_concurrency", "capacity_seconds", "warmup", "procs",
                                           "max_inflight", "seed", "only")}
    report.write_json(dest, {"date": date, "command": getattr(a, "command_line", None), "mode": mode,
                             "machine": report.machine(), "settings": {**settings, "mix": list(MIX)},
                             "capacity_rps": capacity, "runs": runs, "comparison": line})
    out(f"wrote {dest}")
    return 1 if any(r["unanswered"] or r["answered"] != r["sent"] for r in runs.values()) else 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="10 s per run instead of 60")
    p.add_argument("--model", default="resnet", help="demo model served (default resnet)")
    p.add_argument("--duration", type=float, help="open-loop seconds per run (default 60; --quick 10)")
    p.add_argument("--factor", type=float, default=2.0, help="offered load over measured capacity (default 2)")
    p.add_argument("--slo-ms", type=float, default=100.0, help="the model's slo_p99_ms (default 100)")
    p.add_argument("--timeout", type=float, default=0.2, help="each request's timeout in seconds (default 0.2)")
    p.add_argument("--only", choices=("on", "off"), help="only the run with the adaptive limit on, or off")
    p.add_argument("--json", metavar="FILE", help="default: bench/results/overload-<date>.json")
    p.add_argument("--workers", type=int, default=1, help="broker cpu workers (default 1)")
    p.add_argument("--max-batch-size", type=int, default=16,
                   help="the model's max_batch_size (default 16: two batch times well inside the SLO on 2 cores)")
    p.add_argument("--capacity-concurrency", type=int, default=32, help="closed-loop callers for capacity (32)")
    p.add_argument("--capacity-seconds", type=float, help="measured capacity seconds (default 5; --quick 3)")
    p.add_argument("--warmup", type=float, help="unmeasured seconds before the capacity window (2; --quick 1)")
    p.add_argument("--procs", type=int, default=0, help="generator processes (default: half the cores, 2..4)")
    p.add_argument("--max-inflight", type=int, default=0,
                   help="sender threads over all processes (default: rate x (timeout + 0.1 s) x 1.25)")
    p.add_argument("--seed", type=int, default=1, help="seed of arrivals and priorities (default 1)")
