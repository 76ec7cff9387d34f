"""The sequence benchmark's model and callers (`tgw-bench sequences`).

The model is a recurrent step written for Triton's PyTorch backend: a TorchScript file whose
forward(INPUT [B, D], INPUT_STATE [B, H]) returns (OUTPUT [B, D], OUTPUT_STATE [B, H]) - a GRU cell
and a linear head. The same file is served twice:

* as a sequence model (`sequence_batching`, implicit state INPUT_STATE -> OUTPUT_STATE): each
  step sends INPUT with its sequence's id and flags; the worker keeps the state in its slot;
* as a plain model (the baseline: identical compute, the state as an ordinary input and output):
  each step sends INPUT and the state the previous step returned, and gets both back.

Both are driven the same way: S sequences at once on one AsyncClient, each its steps one after
another (a step is sent when the previous one answered), so the batches the broker forms are of
the same sizes. Each sequence's last OUTPUT is checked against an in-process run of its steps.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

import numpy as np

D, H = 64, 256               # input/output width, state width (full)
QUICK_D, QUICK_H = 8, 16


def save_model(path: str, d: int, h: int, seed: int) -> str:
    import torch

    class Step(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cell = torch.nn.GRUCell(d, h)
            self.head = torch.nn.Linear(h, d)

        # the arguments named as the config's inputs and state (Triton's FORWARD_ARGUMENT naming)
        def forward(self, INPUT: torch.Tensor, INPUT_STATE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: N803
            s = self.cell(INPUT, INPUT_STATE)
            return self.head(s), s

    torch.manual_seed(seed)
    torch.jit.save(torch.jit.script(Step().eval()), path)
    return path


def inputs(sequences: int, steps: int, d: int, seed: int) -> np.ndarray:
    """Every step's INPUT: [sequences, steps, d] float32, seeded."""
    return np.random.default_rng(seed).standard_normal((sequences, steps, d)).astype(np.float32)


def reference(path: str, xs: np.ndarray, h: int) -> np.ndarray:
    """Each sequence's last OUTPUT, run in this process from a zero state: [sequences, d]."""
    import torch
    m = torch.jit.load(path)
    state = torch.zeros(xs.shape[0], h)
    out = None
    with torch.inference_mode():
        for t in range(xs.shape[1]):
            out, state = m(torch.from_numpy(xs[:, t]), state)
    return out.numpy()


def entries(seq_name: str, plain_name: str, path: str, d: int, h: int, sequences: int) -> list[dict[str, Any]]:
    """The two model entries: the sequence model and the plain baseline, one file."""
    common = {"versions": [{"version": "1", "path": path, "format": "torchscript"}],
              "max_batch_size": sequences, "max_queue": 4096, "timeout_ms": 600_000}
    x = {"name": "INPUT", "dtype": "float32", "shape": [d]}
    y = {"name": "OUTPUT", "dtype": "float32", "shape": [d]}
    return [
        {"name": seq_name, **common, "inputs": [x], "outputs": [y],
         "sequence_batching": {"max_sequences": sequences, "max_sequence_idle_us": 60_000_000,
                               "state": [{"name": "INPUT_STATE", "output": "OUTPUT_STATE", "dtype": "float32",
                                          "shape": [h], "initial": 0.0}]}},
        {"name": plain_name, **common,
         "inputs": [x, {"name": "INPUT_STATE", "dtype": "float32", "shape": [h]}],
         "outputs": [y, {"name": "OUTPUT_STATE", "dtype": "float32", "shape": [h]}]}]


def sequence_options(cid: int, start: bool, end: bool) -> dict[str, Any]:
    """The native client's options that make an infer one step of sequence `cid` (docs/SEQUENCES.md)."""
    return {"sequence_id": cid, "sequence_start": start, "sequence_end": end}


async def _drive(address: str, model: str, xs: np.ndarray, h: int, stateful: bool, first_id: int,
                 timeout: float) -> dict[str, Any]:
    from tgw.client import AsyncClient
    sequences, steps = xs.shape[:2]
    last: list[Optional[np.ndarray]] = [None] * sequences
    errors: dict[str, int] = {}
    latencies: list[float] = []

    async def one(ac, i: int) -> None:
        state = np.zeros((1, h), np.float32)
        try:
            for t in range(steps):
                t0 = time.perf_counter()
                if stateful:
                    out = await ac.infer(model, {"INPUT": xs[i, t][None]}, timeout=timeout,
                                         **sequence_options(first_id + i, t == 0, t == steps - 1))
                else:
                    out = await ac.infer(model, {"INPUT": xs[i, t][None], "INPUT_STATE": state}, timeout=timeout)
                    state = np.asarray(out["OUTPUT_STATE"]).reshape(1, h)
                latencies.append(time.perf_counter() - t0)
            last[i] = np.asarray(out["OUTPUT"]).reshape(-1)   # only a sequence that ran every step
        except Exception as exc:  # noqa: BLE001 - recorded: the row counts its failures
            key = f"{type(exc).__name__}: {exc}"[:160]
            errors[key] = errors.get(key, 0) + 1

    async with AsyncClient(address) as ac:
        await ac.health()   # connected before the clock starts
        t0 = time.perf_counter()
        await asyncio.gather(*(one(ac, i) for i in range(sequences)))
        wall = time.perf_counter() - t0
    return {"last": last, "errors": errors, "wall_s": wall, "latencies": latencies}


def run_sequences(address: str, model: str, xs: np.ndarray, h: int, stateful: bool, expected: np.ndarray,
                  first_id: int = 1, timeout: float = 120.0) -> dict[str, Any]:
    """All sequences at once, each its steps in turn: steps/s, step latency p50/p99, sequences
    failed, and those whose last output differs from the in-process run."""
    r = asyncio.run(_drive(address, model, xs, h, stateful, first_id, timeout))
    lat = np.asarray(r["latencies"]) * 1e3
    done = [i for i, v in enumerate(r["last"]) if v is not None]
    wrong = [i for i in done if not np.allclose(r["last"][i], expected[i], rtol=1e-3, atol=1e-4)]
    return {"sequences": xs.shape[0], "steps_per_sequence": xs.shape[1], "steps": len(lat), "wall_s": r["wall_s"],
            "steps_per_s": len(lat) / r["wall_s"] if r["wall_s"] > 0 else None,
            "step_ms": {"p50": float(np.percentile(lat, 50)) if len(lat) else None,
                        "p99": float(np.percentile(lat, 99)) if len(lat) else None},
            "sequences_failed": sum(r["errors"].values()), "errors": r["errors"],
            "sequences_checked": len(done), "sequences_wrong": len(wrong)}
