"""The in-process floor: the TorchScript model called directly, no IPC, no serialisation.

Spawned copies (one per core), each with one intra-op thread - tgw's cpu worker layout - and the
module frozen as tgw's worker does, time each batch size in lockstep: samples/s is the sum over
the copies (the box's compute limit for this layout), latencies are per call. Only the copies
import torch. bench/README.md says why batch 1, max/4 and max, and why the best of two rounds.
"""
from __future__ import annotations

import multiprocessing as mp
import queue
import resource
import signal
import time
from typing import Any, Callable, Optional

import numpy as np

from tgw.bench.loadgen import cpu_seconds
from tgw.bench.targets import VAR_LEN


def _load(path: str, how: str):
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


def _copy(path: str, how: str, shape: list[int], dtype: str, batches: list[int], seconds: float, warmup: float,
          threads: int, barrier, results) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops the copies
    import torch
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    module, how = _load(path, how)
    dt, out = getattr(torch, dtype), []
    with torch.inference_mode():
        for b in batches:
            x = torch.randn(b, *shape).to(dt) if dt.is_floating_point else torch.randint(0, 1000, (b, *shape), dtype=dt)
            barrier.wait()
            # at least 3 calls: TorchScript's profiling executor optimises on the second run
            end, n = time.perf_counter() + warmup, 0
            while n < 3 or time.perf_counter() < end:
                module(x)
                n += 1
            barrier.wait()
            lat, t_start = [], time.perf_counter()
            while True:
                t0 = time.perf_counter()
                module(x)
                t1 = time.perf_counter()
                lat.append(t1 - t0)
                if t1 >= t_start + seconds and len(lat) >= 5:
                    break
            out.append({"batch": b, "lat": lat, "elapsed": time.perf_counter() - t_start})
    results.put({"module": how, "torch": torch.__version__, "runs": out})


def floor_batches(max_batch: int) -> list[int]:
    return sorted({1, max(1, max_batch // 4), max_batch})


def measure_floor(model: dict[str, Any], seconds: float, procs: int, threads: int = 1,
                  module: str = "freeze") -> dict[str, Any]:
    """One round for one model (a demo declaration: path, inputs, max_batch_size)."""
    import psutil
    inp, batches = model["inputs"][0], floor_batches(model["max_batch_size"])
    shape = [VAR_LEN if d == -1 else int(d) for d in inp["shape"]]
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(procs, timeout=300), ctx.Queue()
    args = (model["path"], module, shape, inp["dtype"], batches, seconds, min(1.0, seconds / 2), threads, barrier, results)
    machine0, child0, t0 = psutil.cpu_times(), cpu_seconds(resource.RUSAGE_CHILDREN), time.monotonic()
    copies = [ctx.Process(target=_copy, args=args, daemon=True) for _ in range(procs)]
    out: list[dict] = []
    try:
        for p in copies:
            p.start()
        while len(out) < procs:
            try:
                out.append(results.get(timeout=1))
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in copies):
                    raise RuntimeError(f"a floor copy exited with {[p.exitcode for p in copies]}") from None
    finally:
        for p in copies:
            p.join(10)
            if p.is_alive():
                p.terminate()  # by PID, only the copies started here
                p.join(5)
    machine1, child1, wall = psutil.cpu_times(), cpu_seconds(resource.RUSAGE_CHILDREN), time.monotonic() - t0
    runs = []
    for i, b in enumerate(batches):
        ms = np.concatenate([np.asarray(c["runs"][i]["lat"]) for c in out]) * 1e3
        calls_per_s = sum(len(c["runs"][i]["lat"]) / c["runs"][i]["elapsed"] for c in out)
        runs.append({"batch": b, "calls": int(ms.size), "calls_per_s": calls_per_s, "samples_per_s": calls_per_s * b,
                     "latency_ms": {"p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99)),
                                    "mean": float(ms.mean())}})
    busy_cores = max(0.0, (sum(machine1) - sum(machine0) - (machine1.idle - machine0.idle)) / wall)
    return {"path": model["path"], "procs": procs, "threads": threads, "module": out[0]["module"],
            "torch": out[0]["torch"], "runs": runs,
            "background_cpu_cores": max(0.0, busy_cores - (child1 - child0) / wall)}


def _best(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Per batch size, the faster of two rounds."""
    runs = {r["batch"]: r for r in a["runs"]}
    for r in b["runs"]:
        if r["batch"] not in runs or r["samples_per_s"] > runs[r["batch"]]["samples_per_s"]:
            runs[r["batch"]] = r
    return {**a, "runs": [runs[k] for k in sorted(runs)], "rounds": a.get("rounds", 1) + 1,
            "background_cpu_cores": min(a.get("background_cpu_cores", 0), b.get("background_cpu_cores", 0))}


def run_floors(models: dict[str, dict], names: list[str], seconds: float, procs: int, log: Callable[[str], None],
               previous: Optional[dict[str, Any]] = None, module: str = "freeze") -> dict[str, Any]:
    """model -> measure_floor()'s result (the best of this round and `previous`) or {"error": ...}."""
    out: dict[str, Any] = {}
    for name in names:
        prev = (previous or {}).get(name)
        try:
            res = measure_floor(models[name], seconds, procs, module=module)
        except Exception as exc:  # noqa: BLE001 - record and go on
            out[name] = prev or {"error": f"{type(exc).__name__}: {exc}"}
            log(f"in-process floor {name} FAILED: {type(exc).__name__}: {exc}")
            continue
        out[name] = _best(prev, res) if prev and "error" not in prev else res
        b1, bmax = res["runs"][0], res["runs"][-1]  # this round's numbers; the row keeps the best of all
        log(f"in-process floor {name}: batch 1 {b1['samples_per_s']:,.0f} sps (p50 {b1['latency_ms']['p50']:.3f} ms), "
            f"batch {bmax['batch']} {bmax['samples_per_s']:,.0f} sps; background load "
            f"{res['background_cpu_cores']:.2f} cores")
    return out


def floor_row(floor: dict[str, Any]) -> dict[str, Any]:
    """A table row: req/s = the best samples/s over the batch sizes, latency = one batch-1 call."""
    if "error" in floor:
        return floor
    b1, bmax = floor["runs"][0], floor["runs"][-1]  # runs are sorted by batch size
    best = max(floor["runs"], key=lambda r: r["samples_per_s"])  # large batches are not always faster
    bg = floor.get("background_cpu_cores")
    return {"throughput_rps": best["samples_per_s"], "rows_per_s": best["samples_per_s"],
            "latency_ms": {"p50": b1["latency_ms"]["p50"], "p90": None, "p99": b1["latency_ms"]["p99"], "p99_9": None},
            "requests_failed": 0, "errors": {},
            "floor": {"batch1_samples_per_s": b1["samples_per_s"], "max_batch": bmax["batch"],
                      "max_batch_samples_per_s": bmax["samples_per_s"], "best_batch": best["batch"],
                      "procs": floor.get("procs"), "threads": floor.get("threads"),
                      "module": floor.get("module"), "rounds": floor.get("rounds", 1)},
            "machine": {"other_cpu_cores": bg},
            "warnings": [f"other processes used {bg:.2f} cores while the floor was measured"] if (bg or 0) >= 0.25 else []}
