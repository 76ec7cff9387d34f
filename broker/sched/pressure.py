"""A worker's memory pressure, as a fraction, for the circuit breaker's memory trip.

CPU workers: the worker's RSS (from its heartbeat) against the host's memory. GPU workers: the
device's used memory against its total, both read from NVML by the worker for its own GPU and
sent in its heartbeat (`gpu`), which counts every process on the device; where NVML cannot
answer, the worker's own reserved CUDA memory against its device's total (from its hello).
"""
from __future__ import annotations

import psutil

from tgw.shm.wire import Heartbeat

_host_total: int | None = None


def host_memory() -> int:
    global _host_total
    if _host_total is None:
        _host_total = psutil.virtual_memory().total
    return _host_total


def memory_fraction(device: str, beat: Heartbeat, device_total: int = 0) -> float:
    if device.startswith("cuda:"):
        gpu = beat.gpu
        used = max((gpu.memory_used or 0) if gpu else 0, beat.cuda_reserved)
        total = (gpu.memory_total if gpu else None) or device_total
        if total:
            return used / total
    return beat.rss / host_memory()
