"""Memory runs the tests make at a small size and the retired benchmarks made at full size
(docs/MEMORY.md; bench/results/RETIRED.md): on-demand "wide" models whose activations dwarf their
weights, asked for once each on two CPU workers under a placement policy (`placement_run`); and
the recycle on fragmentation: two on-demand models under a budget that holds one, asked for in
turn, so every request loads one and unloads the other (`fragmentation_run`). Each run starts a
broker of its own.
"""
from __future__ import annotations

import os
import tempfile
import time
from collections import Counter

import numpy as np

from tgw.client import Client
from tgw.shm.errors import TgwError
from tgw.testing.child import BrokerProc
from tgw.testing.lifecycle import WIDTH, model_decl, save_add_model

MIB = 1 << 20
WIDE = 512 * 1024      # activation floats per row of the wide model: 2 MiB a row
WARMUP_ROWS = 16       # 32 MiB of activation at the largest warm-up size
PAD = 2 << 20          # floats: 8 MiB of weights per model of the fragmentation run


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
    """On-demand wide models named by the letters of `names`, warmed at 1 and WARMUP_ROWS rows."""
    return [model_decl(n, [("1", save_wide_model(os.path.join(d, f"{n}.pt"), k))], residency="on_demand",
                       warmup_batch_sizes=[1, WARMUP_ROWS]) for k, n in enumerate(names, 1)]


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


def fragmentation_config(d: str, fragmentation: dict) -> dict:
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


def fragmentation_run(work: str, cycles: int, fragmentation: dict) -> dict:
    """`cycles` load/unload cycles of two on-demand models under a budget that holds one, on a broker
    of its own with supervisor.fragmentation as given (its run: bench/results/fragmentation-*.json)."""
    d = tempfile.mkdtemp(prefix="m-", dir=work)
    b = BrokerProc(fragmentation_config(d, fragmentation), tempfile.mkdtemp(prefix="tgwg-", dir="/tmp")).start()
    try:
        return {"fragmentation": fragmentation, **run_cycles(b.address, cycles)}
    finally:
        b.stop()
