"""Outputs of the comparison: machine description, bench/RESULTS.md sections, the PNG."""
from __future__ import annotations

import os
import platform
import re
from importlib import metadata
from typing import Any

from tgw.bench.compare_rows import LABELS, SYSTEMS, format_markdown, table_rows

RESULTS_HEADER = """# tgw benchmark results

Written by `bench/compare.py` (see bench/README.md for what each row means and how the load
generator was checked). Each section is replaced by the latest run of its mode; the raw numbers
of every run are in `bench/results/<date>.json`. Compare ratios, not absolute numbers: this
machine is shared and noisy.
"""


def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.M)
            cpu = m.group(1).strip() if m else cpu
    except OSError:
        pass
    mem = None
    try:
        with open("/proc/meminfo") as f:
            m = re.search(r"^MemTotal:\s*(\d+) kB", f.read(), re.M)
            mem = round(int(m.group(1)) / 2**20, 1) if m else None
    except OSError:
        pass
    versions = {}
    for pkg in ("torch", "pyzmq", "numpy", "msgspec", "flask", "gunicorn"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    try:
        import zmq
        versions["libzmq"] = zmq.zmq_version()
    except ImportError:
        pass
    return {"cores": os.cpu_count(), "cpu_model": cpu, "mem_gib": mem, "kernel": platform.release(),
            "python": platform.python_version(), "versions": versions}


def machine_line(m: dict[str, Any]) -> str:
    v = m["versions"]
    return (f"{m['cores']} cores, {m['cpu_model']}, {m['mem_gib']} GiB RAM, Linux {m['kernel']}, "
            f"Python {m['python']}, torch {v.get('torch')}, pyzmq {v.get('pyzmq')} (libzmq {v.get('libzmq')}), "
            f"gunicorn {v.get('gunicorn')}, Flask {v.get('flask')}")


def section_markdown(result: dict[str, Any], json_rel: str, png_rel: str) -> str:
    s = result["settings"]
    lines = [
        f"## {result['mode']} run - {result['date']}",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Machine: {machine_line(result['machine'])}",
        "",
        f"Settings: {s['duration']:g} s measured per row after {s['warmup']:g} s warm-up; tgw broker with "
        f"{s['tgw_workers']} cpu worker(s) x 1 thread; gunicorn {s['flask_workers']} sync workers x 1 torch "
        f"thread; in-process floor: {s['floor_procs']} model copies x 1 torch thread; HTTP load generator: "
        f"{s['http_generator']}; wall time {result['wall_s']:.0f} s.",
        "",
        format_markdown(table_rows(result["scenarios"])),
        "",
        "req/s of the in-process floor is samples/s (sps) summed over its copies at the best of batch 1, "
        "max/4 and max (that batch size is in the batch column); its p50/p99 are one batch-1 call. batch of "
        "tgw = mean rows per batch the broker formed. tgw/Flask = throughput ratio; tgw/floor = tgw rows/s "
        "over the floor's samples/s. gen CPU = cores used by the load generator in the window.",
        "",
        f"Raw results: `{json_rel}`; plot: `{png_rel}` .",
    ]
    warnings = [f"- {sc['scenario']} / {LABELS[name]}: {w}" for sc in result["scenarios"]
                for name in SYSTEMS for w in (sc["rows"].get(name) or {}).get("warnings", [])]
    if warnings:
        lines += ["", "Warnings raised during this run:", "", *warnings]
    return "\n".join(lines) + "\n"


SECTIONS = ("full", "quick", "custom")


def _block_re(section: str) -> "re.Pattern[str]":
    return re.compile(re.escape(f"<!-- {section}:start -->") + r".*?" + re.escape(f"<!-- {section}:end -->"), re.S)


def update_results_md(path: str, section: str, body: str) -> None:
    """Replace this mode's section (between its markers), keep the others; full comes first."""
    text = open(path).read() if os.path.exists(path) else RESULTS_HEADER
    blocks = {}
    for name in SECTIONS:
        m = _block_re(name).search(text)
        if m:
            blocks[name] = m.group(0)
            text = text.replace(m.group(0), "")
    blocks[section] = f"<!-- {section}:start -->\n{body}<!-- {section}:end -->"
    head = re.sub(r"\n{3,}", "\n\n", text).rstrip("\n") + "\n"
    with open(path, "w") as f:
        f.write(head + "".join(f"\n{blocks[k]}\n" for k in SECTIONS if k in blocks))


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    scen = result["scenarios"]
    names = [s["scenario"] for s in scen]
    systems = [x for x in SYSTEMS if any(x in s["rows"] for s in scen)]
    x = np.arange(len(names))
    width = 0.8 / max(1, len(systems))
    fig, axes = plt.subplots(2, 1, figsize=(12, 8), sharex=True)
    for i, system in enumerate(systems):
        thr = [(s["rows"].get(system) or {}).get("throughput_rps") or 0 for s in scen]
        p99 = [((s["rows"].get(system) or {}).get("latency_ms") or {}).get("p99") or 0 for s in scen]
        axes[0].bar(x + i * width, thr, width, label=LABELS[system])
        axes[1].bar(x + i * width, p99, width, label=LABELS[system])
    axes[0].set_ylabel("throughput (req/s; floor: samples/s)")
    axes[1].set_ylabel("p99 latency (ms; floor: batch-1 call)")
    for ax in axes:
        ax.set_yscale("log")
        ax.grid(True, axis="y", which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[1].set_xticks(x + width * (len(systems) - 1) / 2, names, rotation=20)
    fig.suptitle(f"tgw compare ({result['mode']}, {result['date']}): {result['machine']['cores']} cores, "
                 f"{result['machine']['cpu_model']}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
