"""Turn the load generator's raw samples into the JSON-able summary of one run."""
from __future__ import annotations

import os
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99, 99.9)
GEN_SATURATED = 0.90      # a Python generator process is GIL-bound to about one core
GEN_SHARE_WARN = 0.25     # generator share of all cores worth a warning when the machine is full


def background_cpu(busy: float | None, own_cores: float) -> float | None:
    """Cores used by processes outside this benchmark: machine busy cores minus ours."""
    if busy is None:
        return None
    return max(0.0, busy * (os.cpu_count() or 1) - own_cores)


def pkey(p: float) -> str:
    return "p" + (f"{p:g}".replace(".", "_"))


def latency_ms(lat_s: np.ndarray) -> dict[str, float | None]:
    if lat_s.size == 0:
        return {**{pkey(p): None for p in PERCENTILES}, "mean": None, "max": None}
    ms = lat_s * 1e3
    out = {pkey(p): float(v) for p, v in zip(PERCENTILES, np.percentile(ms, PERCENTILES))}
    out["mean"], out["max"] = float(ms.mean()), float(ms.max())
    return out


def summarize(raw: dict, batch: int = 1) -> dict[str, Any]:
    spec = raw["spec"]
    ok = int(raw["lat"].size)
    n_err = sum(raw["errors"].values())
    dur = spec.duration
    cpu = raw["gen_cpu_s"]
    per_proc = [c / dur for c in cpu]
    cores = os.cpu_count() or 1
    gen = {
        "procs": raw["procs"], "threads": raw["gen_threads"],
        "cpu_cores": sum(per_proc), "cpu_share_of_machine": sum(per_proc) / cores,
        "cpu_per_proc": per_proc,
        "saturated": any(c >= GEN_SATURATED for c in per_proc),
    }
    out: dict[str, Any] = {
        "mode": spec.mode, "level": spec.level,
        "offered": ("concurrency" if spec.mode == "closed" else "rate_rps"),
        "duration_s": dur, "warmup_s": spec.warmup, "batch": batch,
        "requests_ok": ok, "requests_failed": n_err,
        "throughput_rps": ok / dur, "rows_per_s": ok * batch / dur,
        "latency_ms": latency_ms(raw["lat"]),
        "errors": dict(sorted(raw["errors"].items())),
        "error_messages": raw["error_messages"],
        "generator": gen,
    }
    if spec.mode == "open":
        lag = raw["lag"] * 1e3
        out["send_lag_ms"] = ({"p50": float(np.percentile(lag, 50)), "p99": float(np.percentile(lag, 99))}
                              if lag.size else {"p50": None, "p99": None})
        out["offered_rps"] = spec.level
    return out


def warnings_for(summary: dict) -> list[str]:
    w = []
    gen = summary["generator"]
    if gen["saturated"]:
        if gen.get("kind") == "wrk":
            w.append(f"wrk used {gen['cpu_cores']:.2f} cores: close to its thread count, it may limit the rate")
        else:
            busiest = max(gen["cpu_per_proc"])
            w.append(f"load generator saturated: a generator process used {busiest:.0%} of a core "
                     f"(GIL-bound); rerun with more --procs or fewer threads per process")
    machine = summary.get("machine", {})
    if (machine.get("cpu_busy") or 0) >= 0.97 and gen["cpu_share_of_machine"] >= GEN_SHARE_WARN:
        w.append(f"the machine's CPUs were {machine['cpu_busy']:.0%} busy and the generator used "
                 f"{gen['cpu_share_of_machine']:.0%} of them: it took CPU from the server")
    if summary["mode"] == "open" and summary["throughput_rps"] < 0.95 * summary["level"]:
        w.append(f"achieved {summary['throughput_rps']:.0f} req/s of {summary['level']:g} offered "
                 f"(server over capacity or errors)")
    if summary["requests_ok"] == 0:
        w.append("no request completed inside the measurement window (lengthen --duration)")
    other = machine.get("other_cpu_cores")
    if other is not None and other >= 0.25:
        w.append(f"other processes on this machine used {other:.2f} cores during the window: "
                 f"background load disturbed this row")
    if summary["requests_failed"]:
        w.append(f"{summary['requests_failed']} request(s) failed: {summary['errors']}")
    return w


def merge(results: list[dict], spec: Any, procs: int) -> dict:
    """Merge the generator processes' raw samples (loadgen.run_load's result)."""
    errors: dict[str, int] = {}
    messages: dict[str, str] = {}
    for r in results:
        for k, v in r["errors"].items():
            errors[k] = errors.get(k, 0) + v
        messages.update(r["messages"])
    return {"t": np.concatenate([r["t"] for r in results]),
            "lat": np.concatenate([r["lat"] for r in results]),
            "lag": np.concatenate([r["lag"] for r in results]),
            "errors": errors, "error_messages": messages,
            "gen_cpu_s": [r["cpu_s"] for r in results], "gen_threads": [r["threads"] for r in results],
            "procs": procs, "spec": spec}
