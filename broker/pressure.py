"""A worker's memory pressure, as a fraction, for the circuit breaker's memory trip.

CPU workers: the worker's RSS (from its heartbeat) against the host's memory. GPU workers: the
device's used memory against its total, from NVML (nvidia-ml-py; the broker has no torch),
which counts every process on the device; where NVML cannot answer, the worker's own reserved
CUDA memory from its heartbeat against the device total is used, else the host figure.
"""
from __future__ import annotations

import logging

import psutil

from tgw.shm.wire import Heartbeat

log = logging.getLogger("tgw.broker")
_host_total: int | None = None
_nvml: object | None = None   # the pynvml module once initialised; False when unavailable


def host_memory() -> int:
    global _host_total
    if _host_total is None:
        _host_total = psutil.virtual_memory().total
    return _host_total


def _device_memory(index: int) -> tuple[int, int] | None:
    """(used, total) bytes of GPU `index` by NVML's numbering, or None."""
    global _nvml
    if _nvml is None:
        try:
            import pynvml
            pynvml.nvmlInit()
            _nvml = pynvml
        except Exception as exc:  # no driver, no library: the heartbeat figure stands in
            log.info("NVML unavailable for the breaker's memory trip: %s", exc)
            _nvml = False
    if not _nvml:
        return None
    try:
        info = _nvml.nvmlDeviceGetMemoryInfo(_nvml.nvmlDeviceGetHandleByIndex(index))
        return int(info.used), int(info.total)
    except Exception:
        return None


def memory_fraction(device: str, beat: Heartbeat) -> float:
    if device.startswith("cuda:"):
        used_total = _device_memory(int(device.split(":", 1)[1]))
        if used_total is not None:
            used, total = used_total
            return max(used, beat.cuda_reserved) / total if total else 0.0
    return beat.rss / host_memory()
