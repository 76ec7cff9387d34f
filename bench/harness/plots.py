"""The bench's PNG plots: `tgw-bench load`'s levels and the comparison's scenarios (matplotlib is
imported only to plot)."""
from __future__ import annotations

import contextlib
import os
from typing import Any

import numpy as np

from tgw.bench.harness.report import LATENCY_KEYS, SYSTEMS, label


@contextlib.contextmanager
def _figure(path: str, title: str, rows: int, cols: int, size: tuple[float, float], **kw):
    """Yields the axes of a new figure, then saves it as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(rows, cols, figsize=size, **kw)
    yield axes
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_levels(runs: list[dict[str, Any]], path: str, title: str) -> None:
    """Latency percentiles (log scale) and throughput against the offered load."""
    x = [s["level"] for s in runs]
    xlabel = "concurrency (requests in flight)" if runs[0]["mode"] == "closed" else "offered load (req/s)"
    with _figure(path, title, 1, 2, (11, 4.2)) as (ax1, ax2):
        for key, name in LATENCY_KEYS:
            ax1.plot(x, [s["latency_ms"][key] for s in runs], marker="o", label=name)
        ax1.set(yscale="log", xlabel=xlabel, ylabel="latency (ms)")
        ax2.plot(x, [s["throughput_rps"] for s in runs], marker="o", color="black", label="achieved")
        if runs[0]["mode"] == "open":
            ax2.plot(x, x, linestyle="--", color="grey", label="offered")
        ax2.set(xlabel=xlabel, ylabel="throughput (req/s)")
        for ax in (ax1, ax2):
            ax.legend()
            ax.grid(True, which="both", alpha=0.3)
            if min(x) > 0 and max(x) / min(x) >= 8:
                ax.set_xscale("log", base=2)


def plot_compare(result: dict[str, Any], path: str) -> None:
    """Throughput and p99 per scenario and system, log scale."""
    scen, m = result["scenarios"], result["machine"]
    systems = [x for x in SYSTEMS if any(x in s["rows"] for s in scen)]
    x, width = np.arange(len(scen)), 0.8 / max(1, len(systems))
    title = f"tgw compare ({result['mode']}, {result['date']}): {m['cores']} cores, {m['cpu_model']}"
    with _figure(path, title, 2, 1, (12, 8), sharex=True) as axes:
        for i, system in enumerate(systems):
            rows = [s["rows"].get(system) or {} for s in scen]
            axes[0].bar(x + i * width, [r.get("throughput_rps") or 0 for r in rows], width,
                        label=label(system, next((r for r in rows if "generator" in r), {})))
            axes[1].bar(x + i * width, [(r.get("latency_ms") or {}).get("p99") or 0 for r in rows], width)
        axes[0].set_ylabel("throughput (req/s; floor: samples/s)")
        axes[1].set_ylabel("p99 latency (ms; floor: batch-1 call)")
        for ax in axes:
            ax.set_yscale("log")
            ax.grid(True, axis="y", which="both", alpha=0.3)
        axes[0].legend(fontsize=8)
        axes[1].set_xticks(x + width * (len(systems) - 1) / 2, [s["scenario"] for s in scen], rotation=20)
