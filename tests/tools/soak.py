"""tgw soak: hours of steady load on a broker of its own, and what its processes look like after.

    python -m tools.soak --minutes 60        # scripts/soak.sh --minutes 60
    python -m tools.soak --seconds 30        # the short mode

Starts a broker (BrokerProc; --workers CPU workers) serving the demo models, built at run time
by `python -m tgw.workers.demo_models` (nothing is downloaded). Then, with the bench harness's
generator processes (tgw.bench.harness.loadgen) through tgw.bench.harness.measure:

1. capacity: a closed loop of --concurrency callers for --capacity-seconds (after a warm-up),
   its throughput the capacity;
2. the soak: an open loop (Poisson arrivals, latency counted from the scheduled send) at
   --load (default 0.7) of that capacity for the whole duration, every request counted.

For every process (the broker and each worker, PIDs from `status`), RSS, open fds and threads
right before and right after the soak (psutil), and its peak RSS during it; the requests sent,
OK, errors by code, latency p50/p99; the broker's own counters (stats). Exit status 0; 1 when
a request failed or a process died (a worker replaced, the broker gone); 2 when it could not
start.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional

import psutil

from tgw.testing.child import BrokerProc
from tgw.bench.harness.loadgen import LoadSpec
from tgw.bench.harness.measure import measure
from tgw.bench.harness.report import format_summary
from tgw.bench.harness.targets import TgwTarget
from tgw.testing.demo import command_parser, demo_broker, run_command
from tgw.client import Client

MODELS = ["mlp", "embed"]


def processes(c: Client, broker_pid: int) -> list[dict]:
    """The broker and its workers: role, name, pid, and their RSS (MiB), open fds and threads now."""
    rows = [{"role": "broker", "name": "broker", "pid": broker_pid}]
    rows += [{"role": "worker", "name": w["name"], "pid": w["pid"]} for w in c.status()["workers"]]
    for r in rows:
        try:
            p = psutil.Process(r["pid"])
            with p.oneshot():
                r.update(alive=p.status() != psutil.STATUS_ZOMBIE, rss_mb=p.memory_info().rss / 2**20,
                         fds=p.num_fds(), threads=p.num_threads())
        except psutil.Error:
            r.update(alive=False, rss_mb=None, fds=None, threads=None)
    return rows


def process_table(before: list[dict], after: list[dict], peaks: dict[int, Optional[float]]) -> list[str]:
    f = lambda v, fmt="{:.1f}": "-" if v is None else fmt.format(v)  # noqa: E731
    lines = [f"{'process':<16} {'pid':>7} {'RSS MiB start':>13} {'end':>8} {'peak':>8} {'fds start':>9} {'end':>5} "
             f"{'threads start':>13} {'end':>5}  alive"]
    now = {r["pid"]: r for r in after}
    for b in before:
        a = now.get(b["pid"], {"alive": False})
        lines.append(f"{b['name']:<16} {b['pid']:>7} {f(b['rss_mb']):>13} {f(a.get('rss_mb')):>8} "
                     f"{f(peaks.get(b['pid'])):>8} {f(b['fds'], '{}'):>9} {f(a.get('fds'), '{}'):>5} "
                     f"{f(b['threads'], '{}'):>13} {f(a.get('threads'), '{}'):>5}  {a['alive']}")
    for a in after:
        if a["pid"] not in {b["pid"] for b in before}:
            lines.append(f"{a['name']:<16} {a['pid']:>7} {'(new)':>13} {f(a['rss_mb']):>8}")
    return lines


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    ap = command_parser("python -m tools.soak", __doc__)
    length = ap.add_mutually_exclusive_group(required=True)
    length.add_argument("--minutes", type=float, help="soak duration in minutes")
    length.add_argument("--seconds", type=float, help="soak duration in seconds (short mode)")
    ap.add_argument("--model", default="mlp", choices=MODELS, help="the model loaded (default mlp)")
    ap.add_argument("--workers", type=int, default=2, help="CPU workers (default 2)")
    ap.add_argument("--concurrency", type=int, default=16, help="closed-loop callers for the capacity (default 16)")
    ap.add_argument("--capacity-seconds", type=float, default=5.0, help="measured seconds of the capacity run")
    ap.add_argument("--load", type=float, default=0.7, help="the soak's rate as a fraction of capacity (0.7)")
    ap.add_argument("--procs", type=int, default=0, help="generator processes (default: loadgen's choice)")
    a = ap.parse_args(argv)
    a.duration = a.seconds if a.seconds is not None else a.minutes * 60
    if a.duration <= 0 or a.workers < 1 or a.concurrency < 1 or not 0 < a.load <= 1 or a.capacity_seconds <= 0:
        ap.error("durations > 0, --workers >= 1, --concurrency >= 1, 0 < --load <= 1")
    return a


def run(argv: Optional[list[str]] = None, out: Callable[[str], None] = print) -> tuple[int, dict]:
    """The whole run; returns (exit status, summary). `out` receives the report's lines."""
    a = parse(argv)
    with demo_broker(MODELS, a.workers, out=out) as (broker, _):
        return soak(a, broker, out)


def soak(a: argparse.Namespace, broker: BrokerProc, out: Callable[[str], None]) -> tuple[int, dict]:
    target = TgwTarget(broker.address, a.model, label="tgw")
    with Client(broker.address) as c:
        cap = measure(target, LoadSpec("closed", a.concurrency, a.capacity_seconds, 1.0, a.procs),
                      c.stats()["processes"], stats=c.stats)
        capacity = cap["throughput_rps"]
        out(f"capacity ({a.model}, closed loop, {a.concurrency} callers, {a.capacity_seconds:g} s): "
            f"{capacity:,.1f} req/s, {cap['requests_failed']} failed")
        if capacity <= 0:
            out("soak: no capacity measured")
            return 2, {"capacity": cap}
        rate = a.load * capacity
        out(f"soak: open loop at {rate:,.1f} req/s ({a.load:.0%} of capacity) for {a.duration:g} s")
        before = processes(c, broker.pid)
        restarts0 = {w["name"]: w["restarts"] for w in c.status()["workers"]}
        s = measure(target, LoadSpec("open", rate, a.duration, 0.0, a.procs), c.stats()["processes"],
                    stats=c.stats)
        after = processes(c, broker.pid)
        workers = c.status()["workers"]
        stats = c.stats()
    restarts = sum(w["restarts"] - restarts0.get(w["name"], 0) for w in workers)
    peaks = {p["pid"]: p["peak_rss_mb"] for p in s["server_processes"]}
    died = [b["name"] for b in before if not next((x["alive"] for x in after if x["pid"] == b["pid"]), False)]
    sent = s["requests_ok"] + s["requests_failed"]
    lat = s["latency_ms"]
    out(format_summary({**s, "model": a.model}))
    out(f"requests: {sent:,d} sent, {s['requests_ok']:,d} OK, {s['requests_failed']:,d} failed"
        + (" - " + ", ".join(f"{k} {v}" for k, v in s["errors"].items()) if s["errors"] else ""))
    out("latency ms: " + ("-" if lat["p50"] is None else f"p50 {lat['p50']:.3f}, p99 {lat['p99']:.3f}, "
                                                         f"max {lat['max']:.3f}"))
    for line in process_table(before, after, peaks):
        out(line)
    out(f"worker restarts during the soak: {restarts}; processes gone: {', '.join(died) or 'none'}")
    out("broker stats: " + ", ".join(f"{k} {v}" for k, v in stats.items() if k not in ("models", "processes")))
    code = broker.stop()
    out(f"broker exit status on SIGTERM: {code}")
    failed = bool(s["requests_failed"] or died or restarts or code != 0 or sent == 0)
    out("soak: " + ("FAIL" if failed else "PASS"))
    return (1 if failed else 0), {"capacity_rps": capacity, "rate_rps": rate, "sent": sent,
                                  "ok": s["requests_ok"], "errors": s["errors"], "latency_ms": lat,
                                  "before": before, "after": after, "died": died, "restarts": restarts,
                                  "exit_status": code}


def main(argv: Optional[list[str]] = None) -> int:
    return run_command(run, argv)


if __name__ == "__main__":
    sys.exit(main())
