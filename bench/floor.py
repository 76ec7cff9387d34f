"""The in-process floor: the TorchScript model called directly, no IPC, no serialisation.

Runs in its own process (torch is never imported by the harness itself) and prints one JSON line:

    python -m tgw.bench.floor --path resnet-v1.pt --shape 3,64,64 --batches 1,32 --seconds 2

Each batch size is timed for `--seconds` after a short warm-up, under `torch.inference_mode()`,
with `--threads` intra-op threads (default: all cores - the physical limit of the box). The
module is frozen and optimised for inference when TorchScript allows it (`--no-freeze` keeps it
as loaded); the JSON says which.
"""
from __future__ import annotations

import argparse
import json
import os
import time


def measure(module, example, seconds: float, warmup: float) -> dict:
    import numpy as np
    import torch
    with torch.inference_mode():
        end = time.perf_counter() + warmup
        while time.perf_counter() < end:
            module(example)
        lat = []
        t_start = time.perf_counter()
        end = t_start + seconds
        while True:
            t0 = time.perf_counter()
            module(example)
            t1 = time.perf_counter()
            lat.append(t1 - t0)
            if t1 >= end:
                break
        elapsed = time.perf_counter() - t_start
    ms = np.asarray(lat) * 1e3
    batch = int(example.shape[0])
    return {"batch": batch, "calls": len(lat), "calls_per_s": len(lat) / elapsed,
            "samples_per_s": len(lat) * batch / elapsed,
            "latency_ms": {"p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99)),
                           "mean": float(ms.mean())}}


def load(path: str, freeze: bool):
    import torch
    module = torch.jit.load(path, map_location="cpu").eval()
    if not freeze:
        return module, "as loaded"
    try:
        return torch.jit.optimize_for_inference(torch.jit.freeze(module)), "frozen+optimize_for_inference"
    except Exception as exc:  # noqa: BLE001 - some scripted modules cannot be frozen
        return module, f"as loaded (freeze failed: {type(exc).__name__})"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", required=True)
    ap.add_argument("--shape", required=True, help="input shape without batch dim, e.g. 3,64,64")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--no-freeze", action="store_true")
    a = ap.parse_args(argv)
    import torch
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    module, how = load(a.path, not a.no_freeze)
    shape = [int(d) for d in a.shape.split(",")]
    dtype = getattr(torch, a.dtype)
    runs = []
    for b in [int(x) for x in a.batches.split(",")]:
        if dtype.is_floating_point:
            example = torch.randn(b, *shape).to(dtype)
        else:
            example = torch.randint(0, 1000, (b, *shape), dtype=dtype)
        runs.append(measure(module, example, a.seconds, a.warmup))
    print(json.dumps({"path": a.path, "threads": a.threads, "module": how, "runs": runs}))


if __name__ == "__main__":
    main()
