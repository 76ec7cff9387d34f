"""`tgw-bench lifecycle`: the model lifecycle figures (issue 10) on brokers of its own.

Builds its models (model "m": version k returns x + k), starts a broker for each scenario of
bench/lifecycle.py at the issue's size - swap under 32 closed-loop callers for 30 s, a 90/10
canary over 20,000 requests, a 64 MiB version unloaded, three on-demand 8 MiB models under a
20 MiB budget round robin - prints each one's figures and writes them as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

from tgw.shm.wire import LoadVersion, SetTraffic

from . import lifecycle as lc
from tgw.broker.child import BrokerProc

MIB = 1 << 20


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("lifecycle", help="hot swap under load, canary split, unload RSS, on-demand residency "
                                         "(own brokers)", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="8 callers for 6 s, 4,000 canary requests, 3 rounds")
    p.add_argument("--json", metavar="FILE", help="default: bench/results/lifecycle-<date>.json")
    return p


def broker(d: str, models: list[dict], **workers) -> BrokerProc:
    cfg = {"model_roots": [d], "models": models,
           "workers": {"devices": ["cpu"], "input_arena_mb": 4, "output_arena_mb": 4, **workers}}
    return BrokerProc(cfg, tempfile.mkdtemp(prefix="tgwb-", dir="/tmp")).start()


def scenario(name: str, d: str, models: list[dict], run, **workers) -> dict:
    b = broker(d, models, **workers)
    try:
        t0 = time.monotonic()
        out = run(b.address)
        out["wall_s"] = round(time.monotonic() - t0, 1)
    finally:
        b.stop()
        shutil.rmtree(b.dir, ignore_errors=True)
    print(f"{name}: {json.dumps(out)}", flush=True)
    return out


def run(a: argparse.Namespace) -> int:
    d = tempfile.mkdtemp(prefix="tgw-lifecycle-")
    try:
        p = {k: lc.save_add_model(os.path.join(d, f"add{k}.pt"), k) for k in (1, 2, 3)}
        big = lc.save_add_model(os.path.join(d, "big.pt"), 7, pad_floats=16 << 20)
        demand = {n: lc.save_add_model(os.path.join(d, f"{n}.pt"), k, pad_floats=2 << 20)
                  for k, n in enumerate("abc", 1)}
        m1 = [lc.model_decl("m", [("1", p[1])])]
        results = {
            "swap": scenario("swap", d, m1, lambda addr: lc.swap(
                addr, "m", [("2", p[2]), ("3", p[3])], concurrency=8 if a.quick else 32,
                duration_s=6.0 if a.quick else 30.0)),
            "canary": scenario("canary", d, m1, lambda addr: _canary(addr, p[2], 4_000 if a.quick else 20_000)),
            "unload_rss": scenario("unload_rss", d, m1, lambda addr: lc.unload_rss(addr, "m", "big", big)),
            "residency": scenario("residency", d, [lc.model_decl(n, [("1", path)], residency="on_demand")
                                                   for n, path in demand.items()],
                                  lambda addr: _residency(addr, list(demand), 3 if a.quick else 10),
                                  max_model_memory=20 * MIB),
        }
    finally:
        shutil.rmtree(d, ignore_errors=True)
    out = a.json or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                 f"lifecycle-{time.strftime('%Y%m%d-%H%M%S')}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"command": a.command_line, "quick": a.quick, **results}, f, indent=2)
    print(f"wrote {out}")
    failed = results["swap"]["failed"] or results["swap"]["backward_count"] or results["residency"]["failed"]
    return 1 if failed else 0


def _residency(address: str, models: list[str], rounds: int) -> dict:
    """Round robin over three models that do not fit (every request cold), then over two that do."""
    return {**lc.residency(address, models, rounds), "two_that_fit": lc.residency(address, models[:2], rounds)}


def _canary(address: str, v2: str, n: int) -> dict:
    lc.control(address, LoadVersion(v=0, model="m", version="2", path=v2, weight=10))
    lc.control(address, SetTraffic(v=0, model="m", weights={"1": 90, "2": 10}))
    return lc.canary(address, "m", n=n, keys=500)
