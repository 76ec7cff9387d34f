"""A loaded version's real memory on its device, measured at load and warm-up (docs/MEMORY.md).

On cuda the caching allocator's own figures: weights are memory_allocated's growth across the
load, each warm-up size's activation peak is max_memory_allocated (its peak reset just before)
less what was allocated when it began. On cpu the process's RSS: growth across the load, and
per size the peak RSS (VmHWM, reset by writing 5 to /proc/self/clear_refs) less RSS before it;
where that reset is refused, RSS after the size less RSS before it (what the size kept).
Readings are process-wide: batches of other models computing meanwhile can only add to them.
"""
from __future__ import annotations

import ctypes
import os
from typing import Callable, Iterable, TypeVar

import torch

from tgw.shm.wire import Footprint

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
_malloc_trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc only
R = TypeVar("R")


def grown(before: int, after: int) -> int:
    return max(0, after - before)


def status_bytes(text: str, field: str) -> int:
    """A `kB` figure of /proc/self/status (VmHWM, RssAnon) in bytes; 0 when absent."""
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return status_bytes(f.read(), field)


def rss_bytes() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * PAGE_SIZE


def trim_heap() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them for reuse otherwise)."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def reset_rss_peak() -> bool:
    """VmHWM back to the current RSS (Linux 4.0+); False where /proc refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def compose(weights: int, by_batch: dict[int, int], measured_on: str, floor: int = 0) -> Footprint:
    """A Footprint from its parts; weights never below `floor` (the parameter bytes, which are
    resident however the allocator reused freed memory for them)."""
    return Footprint(weights=max(weights, floor), activation_peak=max(by_batch.values(), default=0),
                     by_batch=dict(by_batch), measured_on=measured_on)


class Gauge:
    """One device's memory as its footprints are measured: now, and the peak since a reset."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._peaks = False   # cpu: whether VmHWM was reset (else only before/after count)

    @property
    def kind(self) -> str:
        return "cuda" if self.cuda else "cpu"

    def now(self) -> int:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return torch.cuda.memory_allocated(self.device)
        return rss_bytes()

    def reset_peak(self) -> int:
        """Start a peak; returns the baseline it is measured from."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:   # freed heap still resident would be reused unseen by RSS: give it back first
            trim_heap()
            self._peaks = reset_rss_peak()
        return self.now()

    def peak(self) -> int:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        now = rss_bytes()
        return max(now, _status("VmHWM")) if self._peaks else now

    def load(self, build: Callable[[], R]) -> tuple[R, int]:
        """What `build` returns, and how much memory it took on the device."""
        before = self.now()
        made = build()
        return made, grown(before, self.now())

    def per_batch(self, sizes: Iterable[int], run: Callable[[int], object]) -> dict[int, int]:
        """Run each size once; its activation peak above what was held when it began."""
        out = {}
        for rows in sizes:
            base = self.reset_peak()
            run(rows)
            out[rows] = max(out.get(rows, 0), grown(base, self.peak()))
        return out


def warm_measured(runner, gauge: Gauge, weights: int) -> None:
    """Warm `runner` up and set its `footprint`. A runner whose warm_up returns its per-size
    peaks (a model's) reports those; one that returns none (a stage) is measured as one
    warm-up, reported as size 0."""
    by_batch: dict[int, int] = {}
    whole = gauge.per_batch([0], lambda _: by_batch.update(runner.warm_up() or {}))
    runner.footprint = compose(weights, by_batch or whole, gauge.kind, floor=runner.nbytes)


def measure_load(build: Callable[[], R], device: torch.device) -> R:
    """Build a runner and warm it up, measured (start-up loads: any failure fails the worker)."""
    gauge = Gauge(device)
    runner, weights = gauge.load(build)
    warm_measured(runner, gauge, weights)
    return runner
