"""Measured footprints (docs/MEMORY.md): the demo models' as their worker measured them at load,
beside their parameter bytes; then on-demand models whose activations dwarf their weights under
a budget that fits two by footprint (three by parameter bytes), round robin; then four of them
asked for once each on two CPU workers with that budget each, under `placement: spread` and
`pack` (which worker holds what after each request).

    python -m tgw.bench.footprint_bench [--out bench/results/footprints-DATE.json] [--rounds 4]

Each part starts a broker of its own.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import tempfile

import numpy as np

from tgw.bench.lifecycle import WIDTH, model_decl, residency
from tgw.broker.child import BrokerProc
from tgw.broker.cli.demo import model_entry
from tgw.client import Client
from tgw.shm.errors import TgwError
from tgw.workers.demo_models import DEMO_MODELS, build_demo_models

MIB = 1 << 20
WIDE = 512 * 1024      # activation floats per row of the wide model: 2 MiB a row
WARMUP_ROWS = 16       # 32 MiB of activation at the largest warm-up size


def save_wide_model(path: str, k: float, pad_floats: int = 256 * 1024) -> str:
    """y = x + k, through a [rows, WIDE] intermediate: 1 MiB of weights, 2 MiB of activation a row."""
    import torch

    class Wide(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.width = WIDE
            self.register_buffer("k", torch.tensor([float(k)]))
            self.register_buffer("pad", torch.zeros(pad_floats))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            wide = x[:, :1].repeat(1, self.width) + self.pad[:1]   # the activation a batch pays for
            return x + self.k + wide[:, :1] * 0

    torch.jit.save(torch.jit.script(Wide()), path)
    return path


def wide_decls(d: str, names: str = "abc") -> list[dict]:
    return [model_decl(n, [("1", save_wide_model(os.path.join(d, f"{n}.pt"), k))], residency="on_demand",
                       warmup_batch_sizes=[1, WARMUP_ROWS]) for k, n in enumerate(names, 1)]


def served_footprints(address: str) -> dict:
    """Version key -> the footprint its worker measured, with the parameter bytes beside it."""
    with Client(address) as c:
        status = c.status()
        out = {}
        for w in status["workers"]:
            for key, fp in w.get("footprints", {}).items():
                name = key.partition(":")[0]
                version = key.partition(":")[2]
                params = next(v["bytes"] for v in c.metadata(name)[0]["versions"] if v["version"] == version)
                out[key] = {**fp, "param_bytes": params, "ratio": round(fp["bytes"] / params, 2) if params else None}
    return out


def demo_footprints(work: str) -> dict:
    models = {n: {**m, **DEMO_MODELS[m["base"]][2]} for n, m in build_demo_models(os.path.join(work, "demo")).items()}
    cfg = {"model_roots": [os.path.join(work, "demo")], "models": [model_entry(n, m) for n, m in models.items()],
           "workers": {"devices": ["cpu"], "input_arena_mb": 16, "output_arena_mb": 16}}
    b = BrokerProc(cfg, tempfile.mkdtemp(prefix="tgwf-", dir="/tmp")).start()
    try:
        return {"warmup_batch_sizes": {n: [1, m["max_batch_size"]] for n, m in models.items()},
                "footprints": served_footprints(b.address)}
    finally:
        b.stop()


def budget_run(work: str, rounds: int) -> dict:
    """Three wide on-demand models; the budget 2.5 footprints, measured first on a broker of its own."""
    d = os.path.join(work, "wide")
    os.makedirs(d, exist_ok=True)
    decls = wide_decls(d)
    probe = BrokerProc({"model_roots": [d], "models": [{**decls[0], "residency": "always"}],
                        "workers": {"devices": ["cpu"], "input_arena_mb": 4, "output_arena_mb": 4}},
                       tempfile.mkdtemp(prefix="tgwf-", dir="/tmp")).start()
    try:
        fp = served_footprints(probe.address)["a:1"]
    finally:
        probe.stop()
    budget = int(2.5 * fp["bytes"])
    b = BrokerProc({"model_roots": [d], "models": decls,
                    "workers": {"devices": ["cpu"], "input_arena_mb": 4, "output_arena_mb": 4,
                                "max_model_memory": budget}}, tempfile.mkdtemp(prefix="tgwf-", dir="/tmp")).start()
    try:
        r = residency(b.address, ["a", "b", "c"], rounds=rounds)
    finally:
        b.stop()
    return {"footprint": fp, "budget": budget, "fits_by_footprint": budget // fp["bytes"],
            "fits_by_param_bytes": budget // fp["param_bytes"], **r}


def placement_run(work: str, policy: str, budget: int) -> dict:
    """Four wide on-demand models asked for once each, in turn, on two CPU workers."""
    d = os.path.join(work, "wide")
    os.makedirs(d, exist_ok=True)
    b = BrokerProc({"model_roots": [d], "models": wide_decls(d, "abcd"),
                    "workers": {"devices": ["cpu", "cpu"], "input_arena_mb": 4, "output_arena_mb": 4,
                                "max_model_memory": budget, "placement": policy}},
                   tempfile.mkdtemp(prefix="tgwf-", dir="/tmp")).start()
    held, failed = [], 0
    try:
        with Client(b.address) as c:
            for m in "abcd":
                try:
                    c.infer(m, {"x": np.zeros((1, WIDTH), np.float32)}, timeout=60)
                except TgwError:
                    failed += 1
                held.append({w["name"]: w["models"] for w in c.status()["workers"]})
            evictions = [e["model"] for e in c.status()["events"] if e["event"] == "evict"]
    finally:
        b.stop()
    return {"policy": policy, "budget_per_worker": budget, "failed": failed, "evictions": evictions,
            "held_after_each": held, "workers_holding_nothing": sum(not ms for ms in held[-1].values())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tgw.bench.footprint_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=f"bench/results/footprints-{datetime.date.today()}.json")
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tgwfp-") as work:
        result = {"command": "python -m tgw.bench.footprint_bench " + shlex.join(argv or sys.argv[1:]),
                  "demo": demo_footprints(work), "budget": budget_run(work, a.rounds)}
        result["placement"] = [placement_run(work, policy, result["budget"]["budget"]) for policy in ("spread", "pack")]
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    b = result["budget"]
    late = [o for o in b["over_budget_footprint"] if o["round"] > 0]   # round 0 loads unmeasured versions
    return 0 if not b["failed"] and not late and not any(p["failed"] for p in result["placement"]) else 1


if __name__ == "__main__":
    sys.exit(main())
