"""The in-process floor: the TorchScript model called directly, no IPC, no serialisation.

Runs in its own processes (the harness itself never imports torch) and prints one JSON line:

    python -m tgw.bench.floor --path resnet-v1.pt --shape 3,64,64 --batches 1,32 --seconds 2

`--procs` copies (default: one per core) each load the model with `--threads` intra-op threads
(default 1) - the same layout as tgw's cpu workers - and time each batch size together, in
lockstep, for `--seconds` after a short warm-up under `torch.inference_mode()`. samples/s is the
sum over the copies (the box's compute limit for this layout); latencies are per call. The module
is frozen with `torch.jit.freeze`, as tgw's worker does (`--module` changes that); the JSON says
how it ran.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import time


def _example(batch: int, shape: list[int], dtype_name: str):
    import torch
    dtype = getattr(torch, dtype_name)
    if dtype.is_floating_point:
        return torch.randn(batch, *shape).to(dtype)
    return torch.randint(0, 1000, (batch, *shape), dtype=dtype)


def load(path: str, how: str):
    """The module as tgw's worker runs it: `freeze` (default) as the worker does, `none` as
    loaded, `optimize` adds torch.jit.optimize_for_inference."""
    import torch
    module = torch.jit.load(path, map_location="cpu").eval()
    if how == "none":
        return module, "as loaded"
    try:
        module = torch.jit.freeze(module)
        if how == "optimize":
            return torch.jit.optimize_for_inference(module), "frozen+optimize_for_inference"
        return module, "frozen"
    except Exception as exc:  # noqa: BLE001 - some scripted modules cannot be frozen
        return module, f"as loaded (freeze failed: {type(exc).__name__})"


def _copy(a: argparse.Namespace, barrier, results) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops the copies
    import torch
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    module, how = load(a.path, a.module)
    shape = [int(d) for d in a.shape.split(",")]
    out = []
    with torch.inference_mode():
        for b in [int(x) for x in a.batches.split(",")]:
            example = _example(b, shape, a.dtype)
            barrier.wait()
            # at least 3 calls: TorchScript's profiling executor optimises on the second run
            end, n = time.perf_counter() + a.warmup, 0
            while n < 3 or time.perf_counter() < end:
                module(example)
                n += 1
            barrier.wait()
            lat = []
            t_start = time.perf_counter()
            end = t_start + a.seconds
            while True:
                t0 = time.perf_counter()
                module(example)
                t1 = time.perf_counter()
                lat.append(t1 - t0)
                if t1 >= end and len(lat) >= 5:
                    break
            out.append({"batch": b, "lat": lat, "elapsed": time.perf_counter() - t_start})
    results.put({"module": how, "torch": torch.__version__, "runs": out})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", required=True)
    ap.add_argument("--shape", required=True, help="input shape without batch dim, e.g. 3,64,64")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--procs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--module", choices=("freeze", "none", "optimize"), default="freeze",
                    help="freeze (default, as tgw's worker does), none, optimize (+optimize_for_inference)")
    a = ap.parse_args(argv)
    import numpy as np
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(a.procs), ctx.Queue()
    procs = [ctx.Process(target=_copy, args=(a, barrier, results), daemon=True) for _ in range(a.procs)]
    for p in procs:
        p.start()
    try:
        copies = [results.get(timeout=300) for _ in procs]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.terminate()
    runs = []
    for i, b in enumerate(int(x) for x in a.batches.split(",")):
        ms = np.concatenate([np.asarray(c["runs"][i]["lat"]) for c in copies]) * 1e3
        calls_per_s = sum(len(c["runs"][i]["lat"]) / c["runs"][i]["elapsed"] for c in copies)
        runs.append({"batch": b, "calls": int(ms.size), "calls_per_s": calls_per_s, "samples_per_s": calls_per_s * b,
                     "latency_ms": {"p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99)),
                                    "mean": float(ms.mean())}})
    print(json.dumps({"path": a.path, "procs": a.procs, "threads": a.threads, "module": copies[0]["module"],
                      "torch": copies[0]["torch"], "runs": runs}))


if __name__ == "__main__":
    main()
