"""The comparison's figures from its rows: each scenario's ratios (tgw over Flask, the floors and
its own native row) and how well the broker's batches used the workers."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from tgw.bench import report

GRPC_SYSTEMS = ("tgw_grpc", "tgw_grpc_stream")


def scenario_result(sc, payload_bytes: int, rows: dict[str, dict]) -> dict[str, Any]:
    """The scenario's rows with tgw native over Flask (throughput, p50), over the floor (rows/s) and
    over the transport floor (throughput); each HTTP row of tgw over Flask (throughput, p50) and over
    tgw native (throughput, broker CPU per request)."""
    def value(system: str, key: str) -> Optional[float]:
        row = rows.get(system) or {"error": None}
        if "error" in row:
            return None
        return row["latency_ms"]["p50"] if key == "p50" else \
            (row.get("cpu_us_per_request") or {}).get("broker") if key == "broker_us" else row[key]

    def ratio(a: str, b: str, key: str) -> Optional[float]:
        x, y = value(a, key), value(b, key)
        return x / y if x is not None and y else None
    # tgw's p50 over what a request cannot avoid: the transport's round trip and one batch-1 forward
    p50s = [value(s, "p50") for s in ("tgw", "transport", "in-process")]
    ratios = {"tgw_over_flask_throughput": ratio("tgw", "flask", "throughput_rps"),
              "tgw_over_flask_p50": ratio("tgw", "flask", "p50"),
              "tgw_over_floor_throughput": ratio("tgw", "in-process", "rows_per_s"),
              "tgw_over_transport_throughput": ratio("tgw", "transport", "throughput_rps"),
              "tgw_p50_excess_ms": None if None in p50s else p50s[0] - p50s[1] - p50s[2]}
    for s in report.TGW_SYSTEMS[1:]:
        ratios.update({f"{s}_over_flask_throughput": ratio(s, "flask", "throughput_rps"),
                       f"{s}_over_flask_p50": ratio(s, "flask", "p50"),
                       f"{s}_over_tgw_throughput": ratio(s, "tgw", "throughput_rps"),
                       f"{s}_broker_us_over_tgw": ratio(s, "tgw", "broker_us")})
    for s in GRPC_SYSTEMS:
        ratios[f"{s}_over_http_bin_throughput"] = ratio(s, "tgw_http_bin", "throughput_rps")
    return {"scenario": sc.key, "model": sc.model, "concurrency": sc.concurrency, "payload_bytes": payload_bytes,
            "rows": rows, "ratios": ratios}


def batching(tgw: dict[str, Any], floor: Optional[dict[str, Any]], workers: int) -> dict[str, Optional[float]]:
    """How well the broker's batches used the workers over the window: `worker_busy`, the share
    of the workers' time spent computing batches (their summed compute_us over window x workers),
    and `compute_over_floor`, their compute time over what the in-process floor takes for the
    same batches (each batch size formed, at the floor's mean latency for that size, interpolated
    between the sizes it measured)."""
    bs = tgw.get("broker_stats") or {}
    us, sizes = bs.get("compute_us"), bs.get("batch_sizes") or {}
    out: dict[str, Optional[float]] = {"worker_busy": None, "compute_us_per_row": None, "compute_over_floor": None}
    if not us or not bs.get("rows"):
        return out
    out["worker_busy"] = us / (tgw["duration_s"] * 1e6 * workers)
    out["compute_us_per_row"] = us / bs["rows"]
    if floor and "error" not in floor and sizes:
        b = [r["batch"] for r in floor["runs"]]
        ms = [r["latency_ms"]["mean"] for r in floor["runs"]]
        floor_us = sum(n * float(np.interp(int(k), b, ms)) * 1000 for k, n in sizes.items())
        out["compute_over_floor"] = us / floor_us if floor_us else None
    return out
