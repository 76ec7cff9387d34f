"""One measured level: the load, from loadgen.py's processes (`loadgen_drive`) or from wrk for
the HTTP rows (`wrk_drive`), plus what the server side did meanwhile: peak RSS and CPU of each
server process, the machine's CPU, and for tgw the diff of the broker's `stats()` across the
window (the batch sizes it formed for exactly the requests measured, plus the in-flight tail).
The result is the JSON-able summary described in bench/README.md.

Without wrk on $PATH (a benchmark does not install system packages) the comparison prints
wrk.WRK_INSTALL_HINT and loads the HTTP rows with loadgen_drive(kind="python-fallback"), as each
of those rows says; wrk.py has wrk's side.
"""
from __future__ import annotations

import os
import re
from typing import Any, Callable, Optional

import numpy as np
import psutil

from tgw.bench.harness.loadgen import LoadSpec, cpu_seconds, run_load

PERCENTILES = (50, 90, 99, 99.9)
GEN_SATURATED = 0.90      # a Python generator process is GIL-bound to about one core
GEN_SHARE_WARN = 0.25     # generator share of all cores worth a warning when the machine is full
def _cpu(p: Optional[psutil.Process]) -> Optional[float]:
    try:
        return sum(p.cpu_times()[:2]) if p else None  # user + system
    except psutil.Error:
        return None


def _peak_rss_mb(p: Optional[psutil.Process], reset: bool = False) -> Optional[float]:
    """The kernel's peak RSS of p (VmHWM); reset first restarts it from the current RSS."""
    try:
        if reset:
            with open(f"/proc/{p.pid}/clear_refs", "w") as f:
                f.write("5")
        with open(f"/proc/{p.pid}/status") as f:
            return int(re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.M).group(1)) / 1024
    except (OSError, AttributeError):  # gone, not ours, or p is None
        return None


def _pss_mb(p: psutil.Process) -> Optional[float]:
    try:
        return p.memory_full_info().pss / 2**20
    except (psutil.Error, AttributeError, OSError):  # gone, not ours, or no PSS on this platform
        return None


def tree_pss_mb(procs: list[Optional[psutil.Process]]) -> tuple[Optional[float], list[int]]:
    """PSS summed over `procs` and all their descendants (each process once): the whole server
    tree's memory, shared pages (libraries, shared-memory arenas) split between their users.
    Returns (MiB or None when none could be read, the PIDs counted)."""
    seen: dict[int, psutil.Process] = {}
    for p in procs:
        if p is None:
            continue
        try:
            for q in [p, *p.children(recursive=True)]:
                seen.setdefault(q.pid, q)
        except psutil.Error:
            continue
    vals = {pid: _pss_mb(q) for pid, q in seen.items()}
    got = [v for v in vals.values() if v is not None]
    return (sum(got) if got else None), sorted(pid for pid, v in vals.items() if v is not None)


def _per_request_us(seconds: Optional[float], requests: int) -> Optional[float]:
    return None if seconds is None or requests <= 0 else seconds / requests * 1e6


class ProcessMonitor:
    """At the window's edges (edge()): CPU of each server process, of the machine and of this
    harness; each process's peak RSS in the window, the kernel's high-water mark, reset at the
    start (where that is refused, the peak since the process started); at the end, each
    process's PSS and the whole server tree's (the listed processes and their descendants)."""

    def __init__(self, processes: list[dict[str, Any]]):
        """processes: [{"role": ..., "pid": ..., ...}] as in `Client.stats()["processes"]`."""
        self.infos, self.procs = [dict(p) for p in processes], []
        for p in processes:
            try:
                self.procs.append(psutil.Process(int(p["pid"])))
            except (psutil.Error, KeyError, ValueError):
                self.procs.append(None)
        self.edges: list[dict[str, Any]] = []

    def edge(self) -> None:
        start = not self.edges
        self.edges.append({"procs": [_cpu(p) for p in self.procs], "machine": psutil.cpu_times(),
                           "self": cpu_seconds(), "peak": [_peak_rss_mb(p, start) for p in self.procs]})
        if not start:  # after the CPU counters, so reading smaps is not charged to the window
            self.edges[-1]["pss"] = [_pss_mb(p) if p else None for p in self.procs]
            self.edges[-1]["tree_pss"] = tree_pss_mb(self.procs)

    def report(self, s: dict[str, Any]) -> None:
        """Adds server_processes (peak RSS, PSS, CPU cores, CPU µs per request), server_pss_mb (the
        whole tree), cpu_us_per_request (broker, workers, server, generator) and machine (busy,
        other processes' cores) to s."""
        dur, cores = s["duration_s"], os.cpu_count() or 1
        a, b = self.edges
        n = s["requests_ok"] + s["requests_failed"]  # the requests measured in the window
        rows = []
        for info, peak, pss, c0, c1 in zip(self.infos, b["peak"], b["pss"], a["procs"], b["procs"]):
            cpu_s = None if None in (c0, c1) else c1 - c0
            rows.append({**info, "peak_rss_mb": None if peak is None else round(peak, 1),
                         "pss_mb": None if pss is None else round(pss, 1),
                         "cpu_cores": None if cpu_s is None else round(cpu_s / dur, 3),
                         "cpu_us_per_request": None if cpu_s is None or n <= 0 else round(cpu_s / n * 1e6, 2)})
        tree, pids = b["tree_pss"]
        s["server_pss_mb"] = None if tree is None else round(tree, 1)
        s["server_pss_pids"] = pids

        def cpu_of(pick) -> Optional[float]:
            got = [(c1 - c0) for info, c0, c1 in zip(self.infos, a["procs"], b["procs"])
                   if pick(info.get("role")) and None not in (c0, c1)]
            return sum(got) if got else None
        # the broker (tgw's, or the transport echo's) apart from the processes doing the work
        # (tgw/echo workers; for Flask every gunicorn process: its master only forks and watches)
        s["cpu_us_per_request"] = {
            "broker": _per_request_us(cpu_of(lambda r: r == "broker"), n),
            "workers": _per_request_us(cpu_of(lambda r: r != "broker"), n),
            "server": _per_request_us(cpu_of(lambda r: True), n),
            "generator": _per_request_us(s["generator"]["cpu_cores"] * dur, n)}
        m0, m1 = a["machine"], b["machine"]
        total = sum(m1) - sum(m0)
        idle = (m1.idle - m0.idle) + (getattr(m1, "iowait", 0) - getattr(m0, "iowait", 0))
        busy = max(0.0, 1 - idle / total) if total > 0 else None
        own = s["generator"]["cpu_cores"] + sum(p["cpu_cores"] or 0 for p in rows) + (b["self"] - a["self"]) / dur
        s["server_processes"] = rows
        # cores used by processes outside this benchmark: the machine's busy cores minus ours
        s["machine"] = {"cpu_busy": busy, "cores": cores,
                        "other_cpu_cores": None if busy is None else max(0.0, busy * cores - own)}


def latency_ms(lat_s: np.ndarray) -> dict[str, Optional[float]]:
    keys = ["p" + f"{p:g}".replace(".", "_") for p in PERCENTILES]
    if lat_s.size == 0:
        return {**dict.fromkeys(keys), "mean": None, "max": None}
    ms = lat_s * 1e3
    return {**{k: float(v) for k, v in zip(keys, np.percentile(ms, PERCENTILES))},
            "mean": float(ms.mean()), "max": float(ms.max())}


def generator(kind: str, threads: list[int], cpu_per_proc: list[float], limit: float = GEN_SATURATED) -> dict:
    """The generator's own CPU (cores per process) and its saturation check."""
    cores = sum(cpu_per_proc)
    return {"kind": kind, "procs": len(threads), "threads": threads, "cpu_cores": cores,
            "cpu_share_of_machine": cores / (os.cpu_count() or 1), "cpu_per_proc": cpu_per_proc,
            "saturated": any(c >= limit for c in cpu_per_proc)}


def summary(spec: LoadSpec, duration: float, batch: int, ok: int, errors: dict[str, int],
            messages: dict[str, str], latency: dict, gen: dict) -> dict[str, Any]:
    """The shape of one level's result, whoever generated the load."""
    out = {"mode": spec.mode, "level": spec.level, "offered": "concurrency" if spec.mode == "closed" else "rate_rps",
           "duration_s": duration, "warmup_s": spec.warmup, "batch": batch,
           "requests_ok": ok, "requests_failed": sum(errors.values()),
           "throughput_rps": ok / duration, "rows_per_s": ok * batch / duration, "latency_ms": latency,
           "errors": dict(sorted(errors.items())), "error_messages": messages, "generator": gen}
    if spec.mode == "open":
        out["offered_rps"] = spec.level
    return out


def loadgen_drive(target: Any, spec: LoadSpec, kind: str = "loadgen", **hooks) -> dict[str, Any]:
    """measure()'s default drive: loadgen.py's processes (kind "python-fallback" for the HTTP rows)."""
    raw = run_load(target, spec, **hooks)
    s = summary(spec, spec.duration, getattr(target, "batch", 1), int(raw["lat"].size), raw["errors"],
                raw["error_messages"], latency_ms(raw["lat"]),
                generator(kind, raw["gen_threads"], [c / spec.duration for c in raw["gen_cpu_s"]]))
    if spec.mode == "open":
        lag = raw["lag"] * 1e3
        s["send_lag_ms"] = {f"p{p}": float(np.percentile(lag, p)) if lag.size else None for p in (50, 99)}
    return s


def warnings_for(s: dict) -> list[str]:
    w, gen, machine = [], s["generator"], s.get("machine", {})
    if gen["saturated"]:
        w.append(f"wrk used {gen['cpu_cores']:.2f} cores, close to its thread count: it may limit the rate"
                 if gen["kind"] == "wrk" else
                 f"load generator saturated: a generator process used {max(gen['cpu_per_proc']):.0%} of a core "
                 f"(GIL-bound); rerun with more --procs")
    if (machine.get("cpu_busy") or 0) >= 0.97 and gen["cpu_share_of_machine"] >= GEN_SHARE_WARN:
        w.append(f"the CPUs were {machine['cpu_busy']:.0%} busy and the generator used "
                 f"{gen['cpu_share_of_machine']:.0%} of them: it took CPU from the server")
    if s["mode"] == "open" and s["throughput_rps"] < 0.95 * s["level"]:
        w.append(f"achieved {s['throughput_rps']:.0f} req/s of {s['level']:g} offered")
    if (machine.get("other_cpu_cores") or 0) >= 0.25:
        w.append(f"other processes used {machine['other_cpu_cores']:.2f} cores during the window")
    return w


def stats_diff(before: dict, after: dict, model: str) -> dict[str, Any]:
    """The broker's counters for `model` between two `stats()` snapshots."""
    b = before.get("models", {}).get(model, {})
    a = after.get("models", {}).get(model, {})

    def counts(key: str) -> dict[str, int]:
        d = {str(k): int(v) - int((b.get(key) or {}).get(k, 0)) for k, v in (a.get(key) or {}).items()}
        return {k: v for k, v in d.items() if v}
    requests, batches, rows = (int(a.get(k, 0)) - int(b.get(k, 0)) for k in ("requests", "batches", "rows"))
    return {"requests": requests, "batches": batches, "rows": rows,
            "compute_us": int(a.get("compute_us", 0)) - int(b.get("compute_us", 0)),
            "mean_batch_rows": rows / batches if batches else None,
            "batch_sizes": dict(sorted(counts("batch_sizes").items(), key=lambda kv: int(kv[0]))),
            "errors": counts("errors")}


def measure(target: Any, spec: LoadSpec, processes: list[dict], stats: Optional[Callable[[], dict]] = None,
            drive: Callable[..., dict] = loadgen_drive) -> dict[str, Any]:
    """drive(target, spec, on_window_start=, on_window_end=) runs the load and returns summary()'s
    shape (loadgen_drive, or wrk_drive for the HTTP rows). stats: the broker's `Client.stats`,
    diffed across the window for target.model."""
    mon, before = ProcessMonitor(processes), {}

    def on_start() -> None:
        if stats:
            before.update(stats())
        mon.edge()
    s = drive(target, spec, on_window_start=on_start, on_window_end=mon.edge)
    s["target"] = target.label
    mon.report(s)
    if stats:
        s["broker_stats"] = stats_diff(before, stats(), target.model)
    s["warnings"] = warnings_for(s)
    return s
