"""The GPU rows' figures and text (gpu_bench.py measures them): the ratios against their goals,
the summary lines, the tables, what failed, the JSON file."""
from __future__ import annotations

from typing import Any, Optional

from tgw.bench import report

# ratio -> (its name in the summary, comparison, goal); each tgw row has its own
TARGETS = {"tgw_over_floor_throughput": ("tgw/floor rows/s", ">=", 0.85),
           "tgw_over_flask_throughput": ("tgw/Flask req/s", ">=", 3.4),
           "tgw_over_flask_p99": ("tgw/Flask p99", "<=", 0.25)}


def _value(row: Optional[dict[str, Any]], key: str) -> Optional[float]:
    if not row or "error" in row:
        return None
    return row["latency_ms"].get(key) if key in ("p50", "p99") else row.get(key)


def ratios(rows: dict[str, Any]) -> dict[str, dict[str, Optional[float]]]:
    """tgw row -> its ratios over the floors and over Flask."""
    def ratio(a: str, b: str, key: str) -> Optional[float]:
        x, y = _value(rows.get(a), key), _value(rows.get(b), key)
        return x / y if x is not None and y else None
    return {t: {"tgw_over_floor_throughput": ratio(t, "floor", "rows_per_s"),
                "tgw_over_floor_from_host_throughput": ratio(t, "floor_from_host", "rows_per_s"),
                "tgw_over_flask_throughput": ratio(t, "flask", "throughput_rps"),
                "tgw_over_flask_p50": ratio(t, "flask", "p50"),
                "tgw_over_flask_p99": ratio(t, "flask", "p99")}
            for t in rows if t.startswith("tgw")}


def met(name: str, value: Optional[float]) -> Optional[bool]:
    _, op, goal = TARGETS[name]
    return None if value is None else (value >= goal if op == ">=" else value <= goal)


def summary_lines(result: dict[str, Any]) -> list[str]:
    """One line per tgw row: its key ratios against their targets (what scripts/gpu-check.sh prints)."""
    lines = []
    for t, r in result["ratios"].items():
        parts = []
        for name, (label, op, goal) in TARGETS.items():
            ok = met(name, r[name])
            verdict = "-" if ok is None else "met" if ok else "MISSED"
            parts.append(f"{label} {report._f(r[name])} ({op} {goal:g}: {verdict})")
        lines.append(f"{t}: " + ", ".join(parts))
    return lines


def table(rows: dict[str, Any], concurrency: int) -> list[list[str]]:
    labels = {"floor": "in-process floor (inputs on the device)",
              "floor_from_host": "in-process floor (host -> device per batch)",
              "flask": "Flask+gunicorn"}
    out = [["row", "req/s", "rows/s", "p50 ms", "p99 ms", "batch", "errors"]]
    for key, row in rows.items():
        name = labels.get(key, "tgw native" + key[3:].replace("[", " ["))
        if key.startswith("floor"):
            name += ", one max batch per call"
        else:
            name = report.label("flask", row) if key == "flask" and "error" not in row else name
            name += f" c={concurrency}"
        if "error" in row:
            out.append([name, "-", "-", "-", "-", "-", row["error"].splitlines()[0][:60]])
            continue
        batch = row["batch"] if key.startswith("floor") else (row.get("broker_stats") or {}).get("mean_batch_rows")
        errs = ", ".join(f"{k} x {v}" for k, v in row.get("errors", {}).items()) or "0"
        out.append([name, report._f(row["throughput_rps"], "{:,.0f}"), report._f(row["rows_per_s"], "{:,.0f}"),
                    report._f(row["latency_ms"]["p50"], "{:.3f}"), report._f(row["latency_ms"]["p99"], "{:.3f}"),
                    report._f(batch, "{:.1f}"), errs])
    return out


def copy_table(copies: dict[str, Any]) -> list[list[str]]:
    labels = {"pageable": "pageable (a shared-memory mapping, as the ring)",
              "registered": "the same mapping after cudaHostRegister",
              "staging": "memcpy into pinned staging, then the copy"}
    out = [["host memory", "us/batch", "GB/s", "p99 us", "wall us"]]
    for key, label in labels.items():
        r = copies.get(key) or {"error": "not run"}
        if "error" in r:
            out.append([label, r["error"][:60], "-", "-", "-"])
        else:
            out.append([label + (f" ({r['memcpy_us']:.0f} + {r['h2d_us']:.0f} us)" if key == "staging" else ""),
                        *(f"{r[k]:.{d}f}" for k, d in (("us_per_batch", 1), ("gb_per_s", 2), ("p99_us", 1),
                                                       ("wall_us", 1)))])
    return out


def failed(result: dict[str, Any]) -> list[str]:
    """What makes the exit status 1: rows with an error or failed requests, unclean broker stops."""
    bad = [f"interrupted (exit {result['interrupted']}): the rows after the last one here were not run"] \
        if "interrupted" in result else []
    bad += [f"{k}: {r['error'].splitlines()[0]}" for k, r in result["rows"].items() if "error" in r]
    bad += [f"{k}: {r['requests_failed']} requests failed" for k, r in result["rows"].items()
            if "error" not in r and r.get("requests_failed")]
    bad += [f"{k}: served no request" for k, r in result["rows"].items()
            if "error" not in r and not k.startswith("floor") and not r.get("requests_ok")]
    bad += [f"{k}: broker exit status {r['broker']['exit_status']}, leftovers {r['broker']['shm_leftovers']}"
            for k, r in result["rows"].items() if "broker" in r
            and (r["broker"]["exit_status"] != 0 or r["broker"]["shm_leftovers"])]
    copies = result.get("copies") or {}
    bad += [f"copies: {copies['error'].splitlines()[0]}"] if "error" in copies else \
        [f"copy {k}: {copies[k]['error']}" for k in ("pageable", "registered", "staging")
         if "error" in copies.get(k, {})]
    return bad


def write(path: Optional[str], result: dict[str, Any]) -> None:
    if path:
        report.write_json(path, result)
        print(f"wrote {path}")
