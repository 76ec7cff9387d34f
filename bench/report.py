"""Printing, JSON and plots for `tgw-bench` results (matplotlib is imported only for --plot)."""
from __future__ import annotations

import json
import os
from typing import Any, Iterable

import numpy as np


def _f(v: Any, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def format_summary(s: dict[str, Any]) -> str:
    lat = s["latency_ms"]
    what = f"concurrency {s['level']:g}" if s["mode"] == "closed" else f"rate {s['level']:g} req/s (Poisson)"
    lines = [
        f"{s.get('model', s.get('target', ''))}: {what}, batch {s['batch']}, "
        f"{s['duration_s']:g}s measured after {s['warmup_s']:g}s warm-up",
        f"  throughput   {s['throughput_rps']:,.1f} req/s ({s['rows_per_s']:,.1f} rows/s), "
        f"{s['requests_ok']:,d} ok, {s['requests_failed']:,d} failed",
        f"  latency ms   p50 {_f(lat['p50'], '{:.3f}')}  p90 {_f(lat['p90'], '{:.3f}')}  "
        f"p99 {_f(lat['p99'], '{:.3f}')}  p99.9 {_f(lat['p99_9'], '{:.3f}')}  max {_f(lat['max'], '{:.3f}')}",
    ]
    if "send_lag_ms" in s:
        lag = s["send_lag_ms"]
        lines.append(f"  send lag ms  p50 {_f(lag['p50'], '{:.3f}')}  p99 {_f(lag['p99'], '{:.3f}')} "
                     f"(scheduled -> sent; counted in latency)")
    if s["errors"]:
        lines.append("  errors       " + ", ".join(f"{k} {v}" for k, v in s["errors"].items()))
        for k, msg in s.get("error_messages", {}).items():
            lines.append(f"    {k}: {msg}")
    bs = s.get("broker_stats")
    if bs:
        dist = " ".join(f"{k}:{v}" for k, v in bs["batch_sizes"].items()) or "-"
        lines.append(f"  batches      {bs['batches']:,d} for {bs['requests']:,d} requests, mean "
                     f"{_f(bs['mean_batch_rows'])} rows; sizes {dist}")
    gen = s["generator"]
    busy = s.get("machine", {}).get("cpu_busy")
    threads = "+".join(str(t) for t in gen["threads"])
    lines.append(f"  generator    {gen['procs']} proc(s) x {threads} threads, {gen['cpu_cores']:.2f} cores "
                 f"({gen['cpu_share_of_machine']:.0%} of the machine); machine CPU busy {_f(busy, '{:.0%}')}")
    for p in s.get("server_processes", []):
        lines.append(f"  {p['role']:<12} pid {p['pid']:<7} {str(p.get('device', '')):<7} peak RSS "
                     f"{p['peak_rss_mb']:8.1f} MB  CPU {_f(p.get('cpu_cores'), '{:.2f}')} cores")
    for w in s.get("warnings", []):
        lines.append(f"  WARNING: {w}")
    return "\n".join(lines)


def format_table(runs: Iterable[dict[str, Any]]) -> str:
    head = (f"{'offered':>10} {'req/s':>10} {'p50 ms':>9} {'p90 ms':>9} {'p99 ms':>9} {'p99.9 ms':>9} "
            f"{'errors':>7} {'gen CPU':>8}")
    rows = [head, "-" * len(head)]
    for s in runs:
        lat = s["latency_ms"]
        off = f"c={s['level']:g}" if s["mode"] == "closed" else f"{s['level']:g}/s"
        rows.append(f"{off:>10} {s['throughput_rps']:>10,.1f} {_f(lat['p50']):>9} {_f(lat['p90']):>9} "
                    f"{_f(lat['p99']):>9} {_f(lat['p99_9']):>9} {s['requests_failed']:>7d} "
                    f"{s['generator']['cpu_cores']:>7.2f}c")
    return "\n".join(rows)


def _jsonable(o: Any) -> Any:
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def write_json(path: str, data: Any) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2, default=_jsonable)
        f.write("\n")


def plot_levels(runs: list[dict[str, Any]], path: str, title: str) -> None:
    """Latency percentiles (log scale) and throughput against the offered load."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [s["level"] for s in runs]
    xlabel = "concurrency (requests in flight)" if runs[0]["mode"] == "closed" else "offered load (req/s)"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, label in (("p50", "p50"), ("p90", "p90"), ("p99", "p99"), ("p99_9", "p99.9")):
        ax1.plot(x, [s["latency_ms"][key] for s in runs], marker="o", label=label)
    ax1.set_yscale("log")
    ax1.set_xlabel(xlabel)
    ax1.set_ylabel("latency (ms)")
    ax1.legend()
    ax1.grid(True, which="both", alpha=0.3)
    ax2.plot(x, [s["throughput_rps"] for s in runs], marker="o", color="black", label="achieved")
    if runs[0]["mode"] == "open":
        ax2.plot(x, x, linestyle="--", color="grey", label="offered")
        ax2.legend()
    if min(x) > 0 and max(x) / min(x) >= 8:
        for ax in (ax1, ax2):
            ax.set_xscale("log", base=2)
    ax2.set_xlabel(xlabel)
    ax2.set_ylabel("throughput (req/s)")
    ax2.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
