"""Recycle on fragmentation (docs/MEMORY.md): two on-demand models under a budget that holds one,
asked for in turn, so every request loads one and unloads the other - `--cycles` load/unload
cycles on one CPU worker. Reported: requests failed, recycles, and the serving worker's
anonymous RSS at the end against the fresh worker's (each holding one of the two models), with
supervisor.fragmentation as given and, with --baseline, off.

    python -m tgw.bench.fragmentation_bench [--cycles 200] [--max-mb 0] [--max-share 0.05] [--baseline]
        [--out bench/results/fragmentation-DATE.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import tempfile
import time
from collections import Counter

import numpy as np

from tgw.bench.lifecycle import WIDTH, model_decl, save_add_model
from tgw.broker.child import BrokerProc
from tgw.client import Client
from tgw.shm.errors import TgwError

MIB = 1 << 20
PAD = 2 << 20   # floats: 8 MiB of weights per model


def config(d: str, fragmentation: dict) -> dict:
    models = [model_decl(n, [("1", save_add_model(os.path.join(d, f"{n}.pt"), k, pad_floats=PAD))],
                         residency="on_demand") for k, n in enumerate("ab", 1)]
    return {"model_roots": [d], "models": models,
            "workers": {"devices": ["cpu"], "input_arena_mb": 2, "output_arena_mb": 2, "max_model_memory": 12 * MIB},
            "supervisor": {"heartbeat_s": 0.1, "hang_timeout_s": 5.0, "fragmentation": fragmentation}}


def serving(c: Client) -> dict:
    return next(w for w in c.status()["workers"] if w["state"] == "ready")


def beat_after(c: Client, name: str, beats: int = 3) -> dict:
    """The worker's figures once `beats` more heartbeats came (RSS settles after an unload)."""
    seen, last_age = 0, None
    while True:
        w = next((w for w in c.status()["workers"] if w["name"] == name), None)
        age = w.get("heartbeat_age_s") if w is not None else None
        if age is not None and last_age is not None and age < last_age:   # a new beat
            seen += 1
            if seen >= beats:
                return w
        last_age = age
        time.sleep(0.02)


def run_cycles(address: str, cycles: int, timeout_s: float = 30.0) -> dict:
    """The fresh worker's figures once it holds one model (its first load's one-off costs paid),
    then `cycles` requests alternating between the models; the serving worker's at the end,
    holding one model again (each is 8 MiB of weights)."""
    x = np.zeros((1, WIDTH), np.float32)
    failed, names, highest = Counter(), [], 0
    with Client(address) as c:
        c.infer("a", {"x": x}, timeout=timeout_s)
        fresh = beat_after(c, serving(c)["name"])
        for i in range(cycles):
            try:
                c.infer("ab"[(i + 1) % 2], {"x": x}, timeout=timeout_s)
            except TgwError as err:
                failed[err.code.value] += 1
            w = serving(c)
            if not names or names[-1] != w["name"]:
                names.append(w["name"])
            highest = max(highest, w.get("rss_anon") or 0)
        end = beat_after(c, serving(c)["name"])
    base, last = fresh["rss_anon"], end["rss_anon"]
    return {"cycles": cycles, "failed": dict(failed), "recycles": len(names) - 1, "workers": names,
            "fresh_rss_anon": base, "end_rss_anon": last, "highest_rss_anon": highest,
            "end_vs_fresh_pct": round(100 * (last - base) / base, 2),
            "highest_vs_fresh_pct": round(100 * (highest - base) / base, 2)}


def scenario(work: str, cycles: int, fragmentation: dict) -> dict:
    d = tempfile.mkdtemp(prefix="m-", dir=work)
    b = BrokerProc(config(d, fragmentation), tempfile.mkdtemp(prefix="tgwg-", dir="/tmp")).start()
    try:
        return {"fragmentation": fragmentation, **run_cycles(b.address, cycles)}
    finally:
        b.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tgw.bench.fragmentation_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=200)
    ap.add_argument("--max-mb", type=float, default=0.0)
    ap.add_argument("--max-share", type=float, default=0.05)
    ap.add_argument("--beats", type=int, default=3)
    ap.add_argument("--baseline", action="store_true", help="also run with supervisor.fragmentation off")
    ap.add_argument("--out", default=f"bench/results/fragmentation-{datetime.date.today()}.json")
    a = ap.parse_args(argv)
    runs = {}
    with tempfile.TemporaryDirectory(prefix="tgwfr-") as work:
        if a.baseline:
            runs["off"] = scenario(work, a.cycles, {"max_mb": None, "max_share": None})
        runs["on"] = scenario(work, a.cycles, {"max_mb": a.max_mb, "max_share": a.max_share, "beats": a.beats})
    result = {"command": "python -m tgw.bench.fragmentation_bench " + shlex.join(argv or sys.argv[1:]), **runs}
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    on = runs["on"]
    return 0 if not on["failed"] and on["end_vs_fresh_pct"] <= 5 else 1


if __name__ == "__main__":
    sys.exit(main())
