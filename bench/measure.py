"""One measured level: the load (loadgen.py, or wrk) plus what the server side did meanwhile:
peak RSS and CPU of each server process, the machine's CPU, and for tgw the diff of the broker's
`stats()` across the window (the batch sizes it formed for exactly the requests measured, plus
the in-flight tail). The result is the JSON-able summary described in bench/README.md.
"""
from __future__ import annotations

import os
import sys
import threading
from typing import Any, Callable, Optional

import numpy as np
import psutil

from tgw.bench.loadgen import LoadSpec, run_load

PERCENTILES = (50, 90, 99, 99.9)
GEN_SATURATED = 0.90      # a Python generator process is GIL-bound to about one core
GEN_SHARE_WARN = 0.25     # generator share of all cores worth a warning when the machine is full


def _cpu(p: Optional[psutil.Process]) -> Optional[float]:
    try:
        t = p.cpu_times() if p else None
        return t.user + t.system if t else None
    except psutil.Error:
        return None


def _process(info: dict[str, Any]) -> Optional[psutil.Process]:
    try:
        return psutil.Process(int(info["pid"]))
    except (psutil.Error, KeyError, ValueError):
        return None


class ProcessMonitor:
    """Peak RSS of each process, sampled at 10 Hz in a thread from construction to stop(); CPU of
    each process, of the machine and of this harness at the window's edges."""

    def __init__(self, processes: list[dict[str, Any]]):
        """processes: [{"role": ..., "pid": ..., ...}] as in `Client.stats()["processes"]`."""
        self.procs = [(dict(p), _process(p)) for p in processes]
        self.peak = [0] * len(self.procs)
        self.edges: list[dict[str, Any]] = []  # at window start and end: per-process CPU, machine, self
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tgw-bench-rss", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        stopped = False
        while True:  # one last sample after stop()
            for i, (_, proc) in enumerate(self.procs):
                try:
                    self.peak[i] = max(self.peak[i], proc.memory_info().rss) if proc else 0
                except psutil.Error:
                    pass
            if stopped:
                return
            stopped = self._stop.wait(0.1)

    def edge(self) -> None:
        """Called at the window's start and at its end."""
        self.edges.append({"procs": [_cpu(p) for _, p in self.procs], "machine": psutil.cpu_times(),
                           "self": _cpu(psutil.Process())})

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)

    def report(self, s: dict[str, Any]) -> None:
        """Adds server_processes (peak RSS, CPU cores) and machine (busy, other processes' cores) to s."""
        dur, rows = s["duration_s"], []
        a, b = (self.edges + [None, None])[:2]
        for i, (info, _) in enumerate(self.procs):
            c0, c1 = (a["procs"][i], b["procs"][i]) if b else (None, None)
            rows.append({**info, "peak_rss_mb": round(self.peak[i] / 2**20, 1),
                         "cpu_cores": round((c1 - c0) / dur, 3) if None not in (c0, c1) and dur > 0 else None})
        s["server_processes"] = rows
        busy = other = None
        if b:
            m0, m1 = a["machine"], b["machine"]
            total = sum(m1) - sum(m0)
            idle = (m1.idle - m0.idle) + (getattr(m1, "iowait", 0) - getattr(m0, "iowait", 0))
            busy = max(0.0, 1 - idle / total) if total > 0 else None
            wall = total / (psutil.cpu_count() or 1)
            own = (s["generator"]["cpu_cores"] + sum(p["cpu_cores"] or 0 for p in rows)
                   + ((b["self"] - a["self"]) / wall if wall > 0 else 0.0))
            # cores used by processes outside this benchmark: machine busy cores minus ours
            other = None if busy is None else max(0.0, busy * (os.cpu_count() or 1) - own)
        s["machine"] = {"cpu_busy": busy, "cores": os.cpu_count(), "other_cpu_cores": other}


def latency_ms(lat_s: np.ndarray) -> dict[str, Optional[float]]:
    keys = ["p" + f"{p:g}".replace(".", "_") for p in PERCENTILES]
    if lat_s.size == 0:
        return {**dict.fromkeys(keys), "mean": None, "max": None}
    ms = lat_s * 1e3
    return {**{k: float(v) for k, v in zip(keys, np.percentile(ms, PERCENTILES))},
            "mean": float(ms.mean()), "max": float(ms.max())}


def summarize(raw: dict, batch: int = 1) -> dict[str, Any]:
    """The load generator's raw samples -> the summary of one run."""
    spec, dur = raw["spec"], raw["spec"].duration
    ok, per_proc = int(raw["lat"].size), [c / dur for c in raw["gen_cpu_s"]]
    out: dict[str, Any] = {
        "mode": spec.mode, "level": spec.level, "offered": "concurrency" if spec.mode == "closed" else "rate_rps",
        "duration_s": dur, "warmup_s": spec.warmup, "batch": batch,
        "requests_ok": ok, "requests_failed": sum(raw["errors"].values()),
        "throughput_rps": ok / dur, "rows_per_s": ok * batch / dur, "latency_ms": latency_ms(raw["lat"]),
        "errors": dict(sorted(raw["errors"].items())), "error_messages": raw["error_messages"],
        "generator": {"kind": "loadgen", "procs": raw["procs"], "threads": raw["gen_threads"],
                      "cpu_cores": sum(per_proc), "cpu_share_of_machine": sum(per_proc) / (os.cpu_count() or 1),
                      "cpu_per_proc": per_proc, "saturated": any(c >= GEN_SATURATED for c in per_proc)},
    }
    if spec.mode == "open":
        lag = raw["lag"] * 1e3
        out["send_lag_ms"] = ({"p50": float(np.percentile(lag, 50)), "p99": float(np.percentile(lag, 99))}
                              if lag.size else {"p50": None, "p99": None})
        out["offered_rps"] = spec.level
    return out


def warnings_for(s: dict) -> list[str]:
    w, gen, machine = [], s["generator"], s.get("machine", {})
    if gen["saturated"] and gen["kind"] == "wrk":
        w.append(f"wrk used {gen['cpu_cores']:.2f} cores: close to its thread count, it may limit the rate")
    elif gen["saturated"]:
        w.append(f"load generator saturated: a generator process used {max(gen['cpu_per_proc']):.0%} of a core "
                 f"(GIL-bound); rerun with more --procs or fewer threads per process")
    if (machine.get("cpu_busy") or 0) >= 0.97 and gen["cpu_share_of_machine"] >= GEN_SHARE_WARN:
        w.append(f"the machine's CPUs were {machine['cpu_busy']:.0%} busy and the generator used "
                 f"{gen['cpu_share_of_machine']:.0%} of them: it took CPU from the server")
    if s["mode"] == "open" and s["throughput_rps"] < 0.95 * s["level"]:
        w.append(f"achieved {s['throughput_rps']:.0f} req/s of {s['level']:g} offered (server over capacity or errors)")
    if s["requests_ok"] == 0:
        w.append("no request completed inside the measurement window (lengthen --duration)")
    if (machine.get("other_cpu_cores") or 0) >= 0.25:
        w.append(f"other processes on this machine used {machine['other_cpu_cores']:.2f} cores during the window: "
                 f"background load disturbed this row")
    if s["requests_failed"]:
        w.append(f"{s['requests_failed']} request(s) failed: {s['errors']}")
    return w


def stats_diff(before: dict, after: dict, model: str) -> dict[str, Any]:
    """The broker's counters for `model` between two `stats()` snapshots."""
    b = (before or {}).get("models", {}).get(model, {})
    a = (after or {}).get("models", {}).get(model, {})
    num = lambda k: int(a.get(k, 0)) - int(b.get(k, 0))  # noqa: E731

    def counts(key: str) -> dict[str, int]:
        d = {str(k): int(v) - int((b.get(key) or {}).get(k, 0)) for k, v in (a.get(key) or {}).items()}
        return {k: v for k, v in d.items() if v}
    batches, rows = num("batches"), num("rows")
    return {"requests": num("requests"), "batches": batches, "rows": rows,
            "mean_batch_rows": rows / batches if batches else None,
            "batch_sizes": dict(sorted(counts("batch_sizes").items(), key=lambda kv: int(kv[0]))),
            "errors": counts("errors")}


def _progress(label: str, total_s: float, enabled: Optional[bool]) -> Optional[Callable[[float, int], None]]:
    """A one-line progress bar on stderr, drawn only on a terminal."""
    if not (sys.stderr.isatty() if enabled is None else enabled):
        return None

    def tick(elapsed: float, done: int) -> None:
        frac = min(1.0, max(0.0, elapsed) / total_s) if total_s > 0 else 1.0
        sys.stderr.write(f"\r  {label} [{'#' * int(frac * 30):<30}] {frac * total_s:5.1f}/{total_s:.1f}s "
                         f"{done:>9,d} req ")
    return tick


def loadgen_drive(target: Any, spec: LoadSpec, batch: int = 1, **hooks) -> dict[str, Any]:
    return summarize(run_load(target, spec, **hooks), batch)


def measure(target: Any, spec: LoadSpec, processes: list[dict], batch: int = 1,
            stats_fn: Optional[Callable[[], dict]] = None, model: Optional[str] = None, label: str = "",
            progress: Optional[bool] = None, drive: Callable[..., dict] = loadgen_drive) -> dict[str, Any]:
    """drive(target, spec, batch, on_window_start=, on_window_end=, on_tick=) runs the load and
    returns summarize()'s shape: loadgen_drive, or wrk.drive for the HTTP rows."""
    mon = ProcessMonitor(processes)
    snap: dict[str, Any] = {}

    def on_start() -> None:
        if stats_fn:
            snap["before"] = stats_fn()
        mon.edge()

    tick = _progress(label or f"{spec.mode} {spec.level:g}", spec.warmup + spec.duration, progress)
    try:
        s = drive(target, spec, batch, on_window_start=on_start, on_window_end=mon.edge, on_tick=tick)
        after = stats_fn() if stats_fn else None
    finally:
        mon.stop()
        if tick:
            sys.stderr.write("\r" + " " * 79 + "\r")
    s["target"] = getattr(target, "label", type(target).__name__)
    mon.report(s)
    if stats_fn and model:
        s["broker_stats"] = stats_diff(snap.get("before", {}), after or {}, model)
    s["warnings"] = warnings_for(s)
    return s
