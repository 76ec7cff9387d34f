"""Replay warm-up under traffic (docs/OPERATIONS.md#warm-up): a model slow on its first call per
(batch rows, shape) - it sleeps --sleep-ms once per shape, per version and process
(bench/slow_first.py) - serves closed-loop callers that rotate over a few widths; once warm it
is hot-swapped to a new version under that traffic. Measured: the latency of the requests sent
from the swap command until --after-s seconds after it returned, with replay warm-up
(`warmup.replay: true`) and with `warmup_batch_sizes` only (`warmup.replay: false`), each on a
broker of its own, one after the other in the same run (--runs alternates their order).

    python -m tgw.bench.warmup_bench [--out bench/results/warmup-DATE.json] [--concurrency 8]
        [--widths 16,64,256,1024] [--sleep-ms 200] [--warm-s 15] [--after-s 10] [--runs 1]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import tempfile
import threading
import time

import numpy as np

from tgw.bench.lifecycle import control
from tgw.bench.slow_first import IO, first_calls, save_slow_first
from tgw.broker.child import BrokerProc
from tgw.client import Client
from tgw.shm.errors import TgwError
from tgw.shm.wire import LoadVersion

MODES = {"replay": True, "batch_sizes": False}   # mode -> warmup.replay
WARMUP_BATCH_SIZES = [1, 4, 8]                   # both modes declare these (-1 dims warmed at 8)
LOADER_THREAD = "tgw-loader"                     # the worker's loader thread: loads and warm-ups run there


class Callers:
    """Closed-loop callers, each one request of one row at a time, rotating over the widths;
    every request's send time, latency, version and outcome kept."""

    def __init__(self, address: str, n: int, widths: list[int]):
        self.stop = threading.Event()
        self.log: list[tuple[float, float, str, str]] = []   # (sent, seconds, version, error code or "")
        self.threads = [threading.Thread(target=self._run, args=(address, i, widths), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, address: str, i: int, widths: list[int]) -> None:
        with Client(address) as c:
            k = i
            while not self.stop.is_set():
                x = np.full((1, widths[k % len(widths)]), float(i), np.float32)
                k += 1
                sent = time.monotonic()
                try:
                    version, code = c.infer_with_meta("slow", {"x": x}, timeout=30.0).version, ""
                except TgwError as err:
                    version, code = "", err.code.value
                self.log.append((sent, time.monotonic() - sent, version, code))

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def window(self, start: float, end: float, slow_ms: float) -> dict:
        """The requests sent in [start, end): how many, failed, latency percentiles, how many took
        `slow_ms` or longer (a first call's sleep), by version."""
        rows = [r for r in self.log if start <= r[0] < end]
        ms = np.array([r[1] * 1000 for r in rows if not r[3]])
        versions: dict[str, int] = {}
        for r in rows:
            versions[r[2] or "failed"] = versions.get(r[2] or "failed", 0) + 1
        pct = {f"p{p}_ms": round(float(np.percentile(ms, p)), 2) for p in (50, 99, 99.9)} if ms.size else {}
        return {"requests": len(rows), "failed": sum(1 for r in rows if r[3]), **pct,
                "max_ms": round(float(ms.max()), 2) if ms.size else None,
                "at_least_sleep": int((ms >= slow_ms).sum()), "by_version": versions}


def one(d: str, mode: str, a: argparse.Namespace) -> dict:
    """A broker with warmup.replay as `mode` says: warm traffic, then the swap 1 -> 2 under it."""
    paths = {v: save_slow_first(os.path.join(d, f"{mode}-v{v}.pt"), v, ms=a.sleep_ms) for v in (1, 2)}
    cfg = {"model_roots": [d], "warmup": {"replay": MODES[mode]},
           "workers": {"devices": ["cpu"], "input_arena_mb": 8, "output_arena_mb": 8,
                       "preload": ["tgw.bench.slow_first"]},
           "models": [{"name": "slow", "versions": [{"version": "1", "path": paths[1]}], "max_batch_size": 16,
                       "warmup_batch_sizes": WARMUP_BATCH_SIZES, **IO}]}
    b = BrokerProc(cfg, tempfile.mkdtemp(prefix="tgwwb-", dir="/tmp")).start()
    try:
        callers = Callers(b.address, a.concurrency, a.widths)
        time.sleep(a.warm_s)   # the old version pays its first calls and the sample fills
        with Client(b.address) as c:
            sample = c.status()["models"]["slow"]["replay"]
        t_cmd = time.monotonic()
        reply = control(b.address, LoadVersion(v=0, model="slow", version="2", path=paths[2]))
        t_ret = time.monotonic()
        time.sleep(a.after_s)
        callers.finish()
    finally:
        b.stop()
    paid = first_calls(b.output(), paths[2])   # the new version's first calls: by the loader, or by callers
    load = [e for e in reply.details.get("events", []) if e["event"] == "load" and e["version"] == "2"]
    replay = load[0].get("replay") if load else None
    return {"mode": mode, "warmup_replay": MODES[mode], "sample_before_swap": sample,
            "swap_s": round(t_ret - t_cmd, 3), "load_ms": load[0]["ms"] if load else None,
            "new_version_first_calls": {"in_warm_up": sum(1 for _, thread in paid if thread == LOADER_THREAD),
                                        "by_callers": sum(1 for _, thread in paid if thread != LOADER_THREAD)},
            "replay": {k: replay[k] for k in ("rounds", "p99_ms", "settled", "seconds")} | {
                "batches": len(replay["covered"])} if replay else None,
            "before_swap": callers.window(t_cmd - 5.0, t_cmd, a.sleep_ms),
            "swap_window": callers.window(t_cmd, t_ret + a.after_s, a.sleep_ms),
            "after_return": callers.window(t_ret, t_ret + a.after_s, a.sleep_ms)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tgw.bench.warmup_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=f"bench/results/warmup-{datetime.date.today()}.json")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--widths", type=lambda s: [int(w) for w in s.split(",")], default=[16, 64, 256, 1024])
    ap.add_argument("--sleep-ms", type=float, default=200.0, help="the model's first call per shape")
    ap.add_argument("--warm-s", type=float, default=15.0, help="traffic before the swap")
    ap.add_argument("--after-s", type=float, default=10.0, help="traffic measured after the swap returned")
    ap.add_argument("--runs", type=int, default=1, help="pairs of brokers, their order alternated")
    a = ap.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory(prefix="tgwwb-") as d:
        for n in range(a.runs):
            for mode in (list(MODES) if n % 2 == 0 else list(MODES)[::-1]):
                runs.append(one(d, mode, a))
                print(json.dumps(runs[-1]), flush=True)
    result = {"command": "python -m tgw.bench.warmup_bench " + shlex.join(argv or sys.argv[1:]),
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "cpus": os.cpu_count(),
              "settings": {k: v for k, v in vars(a).items() if k != "out"} | {"warmup_batch_sizes": WARMUP_BATCH_SIZES},
              "runs": runs, "summary": summary(runs)}
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["summary"], indent=1))
    return 0 if not any(r["swap_window"]["failed"] for r in runs) else 1


def summary(runs: list[dict]) -> dict:
    """Per mode, each run's figure of its swap window: percentiles, requests as slow as a first
    call, requests, failures; and the new version's first calls that callers paid."""
    out = {}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        out[mode] = {key: [r["swap_window"].get(key) for r in mine]
                     for key in ("p50_ms", "p99_ms", "p99.9_ms", "max_ms", "at_least_sleep", "requests", "failed")}
        out[mode]["first_calls_by_callers"] = [r["new_version_first_calls"]["by_callers"] for r in mine]
    return out


if __name__ == "__main__":
    sys.exit(main())
