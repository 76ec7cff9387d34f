"""mlp at c=64 on the native socket, with workers.doorbell socket and zmq, in one run.

    .venv/bin/python scripts/doorbell-load.py [--rounds 2] [--duration 10] [--out bench/results/doorbell-load.json]

A broker per setting (the compare scenario's tgw config: one CPU worker a core), started in turn,
`rounds` times alternating so drift on a shared box falls on both; each row is tgw-bench's own
measurement (bench/harness/measure.py): requests/s, p50, and CPU µs per request of the broker
process and of the workers. Prints a table and writes every row as JSON.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile

from tgw.bench.harness import report
from tgw.bench.harness.loadgen import LoadSpec
from tgw.bench.harness.measure import measure
from tgw.bench.harness.targets import TgwTarget
from tgw.client import Client
from tgw.testing.child import BrokerProc
from tgw.testing.demo import demo_models, tgw_config

KINDS = ("socket", "zmq")


def row(models: dict, kind: str, a: argparse.Namespace, work: str) -> dict:
    cfg = tgw_config(models, ["mlp"], a.workers)
    cfg["workers"]["doorbell"] = kind
    d = os.path.join(work, kind)
    os.makedirs(d, exist_ok=True)
    b = BrokerProc(cfg, d)
    try:
        with Client(b.start(timeout=180).address) as c:
            spec = LoadSpec("closed", a.concurrency, a.duration, a.warmup, a.procs)
            r = measure(TgwTarget(b.address, "mlp", timeout=60.0), spec, c.stats()["processes"], stats=c.stats)
    finally:
        code = b.stop()
    us = r.get("cpu_us_per_request") or {}
    out = {"doorbell": kind, "throughput_rps": r["throughput_rps"], "p50_ms": r["latency_ms"]["p50"],
           "broker_us": us.get("broker"), "workers_us": us.get("workers"), "generator_us": us.get("generator"),
           "requests_failed": r["requests_failed"], "broker_exit": code, "row": r}
    print(f"{kind:7} {out['throughput_rps']:>9,.0f} req/s  p50 {out['p50_ms']:.3f} ms  broker {out['broker_us']} us/req"
          f"  workers {out['workers_us']} us/req", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="CPU workers (default: cores)")
    ap.add_argument("--procs", type=int, default=0, help="generator processes (default: tgw-bench's)")
    ap.add_argument("--out", help="JSON file for every row")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="tgwd-", dir="/tmp")   # short: ipc paths must fit 107 bytes
    try:
        models = demo_models(os.path.join(work, "models"))
        rows = [row(models, kind, a, work) for _ in range(a.rounds) for kind in KINDS]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nmlp c={a.concurrency}, {a.workers} CPU worker(s), {a.rounds} round(s) of {a.duration:g} s each "
          f"(medians over the rounds):")
    print(f"{'doorbell':9} {'req/s':>9} {'p50 ms':>8} {'broker us/req':>14} {'workers us/req':>15}")
    summary = {}
    for kind in KINDS:
        mine = [r for r in rows if r["doorbell"] == kind]
        med = {k: _median([r[k] for r in mine if r[k] is not None]) for k in ("throughput_rps", "p50_ms",
                                                                              "broker_us", "workers_us")}
        summary[kind] = med
        print(f"{kind:9} {med['throughput_rps']:>9,.0f} {med['p50_ms']:>8.3f} {med['broker_us']:>14.1f} "
              f"{med['workers_us']:>15.1f}")
    s, z = summary["socket"], summary["zmq"]
    print(f"socket / zmq: req/s {s['throughput_rps'] / z['throughput_rps']:.2f}x, broker CPU per request "
          f"{s['broker_us'] / z['broker_us']:.2f}x, workers' {s['workers_us'] / z['workers_us']:.2f}x")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "date": datetime.datetime.now().isoformat(timespec="seconds"),
                       "machine": report.machine(), "summary": summary, "rows": rows}, f, indent=1)
    return 0 if all(r["requests_failed"] == 0 and r["broker_exit"] == 0 for r in rows) else 1


def _median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return None if not xs else (xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2)


if __name__ == "__main__":
    sys.exit(main())
