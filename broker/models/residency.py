"""On-demand models under each worker's memory budget (workers.max_model_memory).

A version declared `residency: on_demand` is loaded on one worker when a request asks for it
and no worker has it. A load that does not fit the worker's budget first evicts: the least
recently used idle on-demand version there (nothing admitted for it and unanswered), then,
only if none is idle, the least recently used busy one, which takes no new batch on that
worker and unloads once its batches in flight are done. The load waits for the memory to be
returned. Always-resident versions count against the budget but are never evicted, so a
worker exceeds its budget by at most the one model that could not fit beside them.

A version counts what its worker measured at its load (weights + activation peak:
workers/footprint.py), else what it measured at an earlier load, else its parameter bytes plus
the largest activation peak measured on that worker (docs/MEMORY.md). A load measured larger than counted evicts what no longer fits beside it.
Placement is `spread` (the worker with the most budget left) or `pack` (the fullest worker it
still fits on, so whole devices stay free).
"""
from __future__ import annotations

import logging
from typing import Callable, Iterable

import psutil

from tgw.broker.state.pool import WorkerHandle, WorkerState
from tgw.broker.state.versions import VersionRecord

log = logging.getLogger("tgw.broker")


def budget_bytes(max_model_memory: int | float | None, device: str, device_total: int = 0) -> int | None:
    """workers.max_model_memory as bytes: an int is bytes, a float a fraction of the device's
    memory: host RAM for cpu, for cuda:N the GPU's as its worker's hello said (None before)."""
    if max_model_memory is None:
        return None
    if isinstance(max_model_memory, float):
        total = device_total if device.startswith("cuda:") else psutil.virtual_memory().total
        return int(max_model_memory * total) if total else None
    return int(max_model_memory)


def largest_activation(w: WorkerHandle) -> int:
    """The largest activation peak among the versions measured on `w` (0: none)."""
    return max((fp.activation_peak for fp in w.footprints.values() if fp.measured_on), default=0)


class Residency:
    def __init__(self, record: Callable[[str], VersionRecord | None], note: Callable[..., None],
                 policy: str = "spread"):
        self.record = record      # key -> its version record (None: gone)
        self.note = note          # records a lifecycle event (status, metadata)
        self.policy = policy      # workers.placement: spread or pack

    def size(self, w: WorkerHandle, key: str) -> int:
        """Bytes `key` takes on `w`: measured there, else measured elsewhere, else its parameter
        bytes plus the largest activation peak measured on `w` (a guess on the safe side: a load
        counted low evicts only once it is in, and on a GPU may run out of memory first)."""
        fp = w.footprints.get(key)
        if fp is not None and fp.measured_on:
            return fp.total
        rec = self.record(key)
        if rec is not None and rec.footprint is not None and rec.footprint.measured_on:
            return rec.size()
        return (w.sizes.get(key) or (rec.size() if rec is not None else 0)) + largest_activation(w)

    def used(self, w: WorkerHandle) -> int:
        """Bytes its models take, counting those loading and those still unloading."""
        return sum(self.size(w, k) for k in w.models | w.holding.loading.keys() | w.holding.unloading)

    @staticmethod
    def where(key: str, roster: Iterable[WorkerHandle]) -> WorkerHandle | None:
        """A live worker that has, is loading, or was given this version."""
        for w in roster:
            h = w.holding
            if w.state is WorkerState.READY and not w.retiring and key not in h.evicting and \
                    (key in w.models or key in h.loading or key in h.wanted):
                return w
        return None

    def place(self, rec: VersionRecord, roster: list[WorkerHandle]) -> WorkerHandle | None:
        """Give the version to a live worker (spread: the most budget left; pack: the least left
        that still fits it, else as spread); None when no worker is live (a restart will come;
        the requests wait, bounded by their deadlines)."""
        live = [w for w in roster if w.state is WorkerState.READY and not w.retiring]
        if not live:
            return None
        left = {id(w): float("inf") if w.budget is None else w.budget - self.used(w) for w in live}
        fits = [w for w in live if left[id(w)] >= self.size(w, rec.key)] if self.policy == "pack" else []
        if fits:
            w = min(fits, key=lambda w: (left[id(w)], -self.used(w), len(w.inflight)))
        else:
            w = max(live, key=lambda w: (left[id(w)], -len(w.inflight)))
        w.want(rec.key)
        return w

    def room(self, w: WorkerHandle, key: str) -> bool:
        """Whether `key` may start loading on `w` now; if not, choose what to evict for it."""
        if w.budget is None:
            return True
        over = self.used(w) + self.size(w, key) - w.budget
        if over <= 0:
            return True
        h = w.holding
        if h.unloading:
            return False  # memory is on its way back: count again when it is
        evictable = [k for k in w.models if k != key and k not in h.evicting and k in h.wanted]
        if not evictable and not h.evicting:
            return True   # only always-resident models are left: this one may exceed the budget alone
        self._evict_for(w, evictable, over)
        return False

    def settle(self, w: WorkerHandle, key: str) -> None:
        """`key` finished loading on `w`, measured: evict what no longer fits beside it (its
        measured footprint may exceed the parameter bytes it was let in by)."""
        if w.budget is None or (over := self.used(w) - w.budget) <= 0:
            return
        h = w.holding
        self._evict_for(w, [k for k in w.models if k != key and k not in h.evicting and k in h.wanted], over)

    def _evict_for(self, w: WorkerHandle, evictable: list[str], over: int) -> None:
        h = w.holding
        freeing = sum(self.size(w, k) for k in h.evicting)
        # idle first, then least recently used
        for victim in sorted(evictable, key=lambda k: (self._busy(k), h.used_at.get(k, 0.0))):
            if freeing >= over:
                break
            self.evict(w, victim)
            freeing += self.size(w, victim)

    def _busy(self, key: str) -> bool:
        rec = self.record(key)
        return rec is not None and rec.active > 0

    def evict(self, w: WorkerHandle, key: str) -> None:
        w.evict(key)
        rec = self.record(key)
        if rec is not None:
            rec.evicted()
        self.note("evict", key, w, bytes=self.size(w, key), message="least recently used, to make room")
        log.info("%s: evicting %s to make room", w.name, key)
