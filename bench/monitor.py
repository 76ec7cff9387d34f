"""Server-side observations during a run: peak RSS and CPU of each tgw process, machine CPU.

`ProcessMonitor` samples psutil every `interval` seconds in a background thread, so a short
memory spike between samples can be missed; the peak is a lower bound sampled at 10 Hz.
"""
from __future__ import annotations

import threading
from typing import Any, Optional

import psutil


class ProcessMonitor:
    def __init__(self, processes: list[dict[str, Any]], interval: float = 0.1):
        """processes: [{"role": ..., "pid": ..., ...}] as in `Client.stats()["processes"]`."""
        self.procs: list[tuple[dict, Optional[psutil.Process]]] = []
        for p in processes:
            try:
                self.procs.append((dict(p), psutil.Process(int(p["pid"]))))
            except (psutil.Error, KeyError, ValueError):
                self.procs.append((dict(p), None))
        self.interval = interval
        self.peak = [0] * len(self.procs)
        self.cpu0: list[Optional[float]] = [None] * len(self.procs)
        self.cpu1: list[Optional[float]] = [None] * len(self.procs)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tgw-bench-rss", daemon=True)
        self._machine0 = None
        self._machine = None
        self._self0 = self._self1 = self._elapsed = 0.0

    def _sample(self) -> None:
        for i, (_, proc) in enumerate(self.procs):
            if proc is None:
                continue
            try:
                self.peak[i] = max(self.peak[i], proc.memory_info().rss)
            except psutil.Error:
                pass

    def _cpu(self) -> list[Optional[float]]:
        out: list[Optional[float]] = []
        for _, proc in self.procs:
            try:
                t = proc.cpu_times() if proc else None
                out.append(t.user + t.system if t else None)
            except psutil.Error:
                out.append(None)
        return out

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def start(self) -> "ProcessMonitor":
        self._sample()
        self._thread.start()
        return self

    def window_start(self) -> None:
        self.cpu0 = self._cpu()
        self._machine0 = psutil.cpu_times()
        self._self0 = self._own_cpu()

    def window_end(self) -> None:
        self.cpu1 = self._cpu()
        if self._machine0 is not None:
            self._machine = psutil.cpu_times()
            self._self1 = self._own_cpu()
            self._elapsed = sum(self._machine) - sum(self._machine0)

    @staticmethod
    def _own_cpu() -> float:
        t = psutil.Process().cpu_times()
        return t.user + t.system

    def self_cores(self) -> float:
        """Cores the harness process itself (this monitor, stats calls, progress) used in the window."""
        if self._machine is None:
            return 0.0
        wall = self._elapsed / (psutil.cpu_count() or 1)
        return (self._self1 - self._self0) / wall if wall > 0 else 0.0

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2)
        self._sample()

    def machine_cpu_busy(self) -> Optional[float]:
        if self._machine0 is None or self._machine is None:
            return None
        a, b = self._machine0, self._machine
        idle = (b.idle - a.idle) + (getattr(b, "iowait", 0) - getattr(a, "iowait", 0))
        total = sum(b) - sum(a)
        return max(0.0, 1 - idle / total) if total > 0 else None

    def report(self, duration: float) -> list[dict[str, Any]]:
        rows = []
        for i, (info, _) in enumerate(self.procs):
            c0, c1 = self.cpu0[i], self.cpu1[i]
            rows.append({**info, "peak_rss_mb": round(self.peak[i] / 2**20, 1),
                         "cpu_cores": (round((c1 - c0) / duration, 3)
                                       if c0 is not None and c1 is not None and duration > 0 else None)})
        return rows
