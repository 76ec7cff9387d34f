"""One measured load level: the load generator plus what the server side saw meanwhile.

`measure()` runs `loadgen.run_load`, samples the server processes (peak RSS, CPU) and, for tgw,
diffs the broker's `stats()` taken at the start and the end of the measurement window, which
gives the batch sizes the broker actually formed for exactly the requests measured (plus the
in-flight tail). The result is the JSON-able summary described in bench/README.md.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Optional

from tgw.bench.loadgen import LoadSpec, run_load
from tgw.bench.monitor import ProcessMonitor
from tgw.bench.summary import background_cpu, summarize, warnings_for


class Progress:
    """A one-line progress bar on stderr, only when stderr is a terminal."""

    def __init__(self, label: str, total_s: float, enabled: Optional[bool] = None):
        self.label, self.total = label, total_s
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._last = 0.0

    def tick(self, elapsed: float, done: int) -> None:
        if not self.enabled or time.monotonic() - self._last < 0.2:
            return
        self._last = time.monotonic()
        elapsed = max(0.0, elapsed)
        frac = min(1.0, elapsed / self.total) if self.total > 0 else 1.0
        bar = "#" * int(frac * 30)
        sys.stderr.write(f"\r  {self.label} [{bar:<30}] {min(elapsed, self.total):5.1f}/{self.total:.1f}s "
                         f"{done:>9,d} req ")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\r" + " " * 79 + "\r")
            sys.stderr.flush()


def stats_diff(before: dict, after: dict, model: str) -> dict[str, Any]:
    b = before.get("models", {}).get(model, {}) if before else {}
    a = after.get("models", {}).get(model, {}) if after else {}
    num = lambda k: int(a.get(k, 0)) - int(b.get(k, 0))  # noqa: E731
    sizes = {}
    for k, v in (a.get("batch_sizes") or {}).items():
        d = int(v) - int((b.get("batch_sizes") or {}).get(k, 0))
        if d:
            sizes[str(k)] = d
    errors = {}
    for k, v in (a.get("errors") or {}).items():
        d = int(v) - int((b.get("errors") or {}).get(k, 0))
        if d:
            errors[str(k)] = d
    batches, rows = num("batches"), num("rows")
    return {"requests": num("requests"), "batches": batches, "rows": rows,
            "mean_batch_rows": (rows / batches) if batches else None,
            "batch_sizes": dict(sorted(sizes.items(), key=lambda kv: int(kv[0]))), "errors": errors}


def measure(target: Any, spec: LoadSpec, processes: list[dict], batch: int = 1,
            stats_fn: Optional[Callable[[], dict]] = None, model: Optional[str] = None,
            label: str = "", progress: Optional[bool] = None) -> dict[str, Any]:
    mon = ProcessMonitor(processes).start()
    bar = Progress(label or f"{spec.mode} {spec.level:g}", spec.warmup + spec.duration, progress)
    snap: dict[str, Any] = {}

    def on_start() -> None:
        if stats_fn:
            snap["before"] = stats_fn()
        mon.window_start()

    try:
        raw = run_load(target, spec, on_window_start=on_start, on_window_end=mon.window_end, on_tick=bar.tick)
        after = stats_fn() if stats_fn else None
    finally:
        bar.close()
        mon.stop()
    s = summarize(raw, batch)
    s["target"] = getattr(target, "label", type(target).__name__)
    s["server_processes"] = mon.report(spec.duration)
    busy = mon.machine_cpu_busy()
    own = s["generator"]["cpu_cores"] + sum(p["cpu_cores"] or 0 for p in s["server_processes"]) + mon.self_cores()
    s["machine"] = {"cpu_busy": busy, "cores": os.cpu_count(), "other_cpu_cores": background_cpu(busy, own)}
    if stats_fn and model:
        s["broker_stats"] = stats_diff(snap.get("before", {}), after or {}, model)
    s["warnings"] = warnings_for(s)
    return s
