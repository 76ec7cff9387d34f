"""Garbage-collection pauses, timed in every process (broker, fronts, workers), and the freeze.

`watch.install()` hooks gc.callbacks so every collection is timed (two perf_counter_ns calls
and a few integer updates: cheap enough to stay on always); `watch.freeze()` runs one full
collection and then gc.freeze(), which moves every object alive at that point (modules,
configs, models, the loop's machinery) into a permanent generation no later collection walks:
a full collection under load then costs what the request-time objects cost, not the whole
start-up heap. `watch.as_dict()` is what status and metrics show. One `watch` per process.
"""
from __future__ import annotations

import gc
import time
from typing import Any

_SLOW_NS = 1_000_000   # a pause longer than 1 ms is counted (the goal: none under load)


class GcWatch:
    """One process's collection figures. Only the gc callback and freeze()/reset_longest()
    write them; the callback runs with the GIL held, so no lock is needed."""

    def __init__(self) -> None:
        self.frozen = False
        self.longest_ns = 0
        self.last_ns = 0
        self.pauses_over_1ms = 0
        self.collections = [0, 0, 0]   # by generation
        self._start_ns = 0
        self._installed = False
        self._explicit = False          # freeze()'s own collection: start-up, not a pause under load

    def install(self) -> "GcWatch":
        """Time every collection from now on (idempotent)."""
        if not self._installed:
            gc.callbacks.append(self._on_gc)
            self._installed = True
        return self

    def uninstall(self) -> None:
        if self._installed:
            gc.callbacks.remove(self._on_gc)
            self._installed = False

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start_ns = time.perf_counter_ns()
            return
        ns = time.perf_counter_ns() - self._start_ns
        gen = info.get("generation", 0)
        if 0 <= gen <= 2:
            self.collections[gen] += 1
        if self._explicit:
            return
        self.last_ns = ns
        if ns > self.longest_ns:
            self.longest_ns = ns
        if ns > _SLOW_NS:
            self.pauses_over_1ms += 1

    def freeze(self) -> None:
        """Collect once, then move every surviving object to the permanent generation. Called
        once start-up and warm-up are over, so the longest pause counts from here on (as
        reset_longest: a process that does not freeze calls that at the same point)."""
        self._collect_and_freeze()
        self.reset_longest()

    def _collect_and_freeze(self) -> None:
        self._explicit = True
        try:
            gc.collect()
        finally:
            self._explicit = False
        gc.freeze()
        self.frozen = True

    def collect_all(self) -> None:
        """A full collection that reaches the frozen heap too: a start-up model unloaded later
        lives there, and a reference cycle would keep it forever. Unfreeze, collect, freeze
        again: as slow as a full collection without the freeze, and only for such an unload."""
        if not self.frozen:
            gc.collect()
            return
        gc.unfreeze()
        self._collect_and_freeze()

    def reset_longest(self) -> None:
        """Forget the longest pause and the slow count: they count from serving on (freeze() or,
        without the freeze, this at the same point), not over start-up's imports and loads."""
        self.longest_ns = 0
        self.pauses_over_1ms = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "frozen": self.frozen,
            "frozen_objects": gc.get_freeze_count(),
            "longest_pause_ms": self.longest_ns / 1e6,
            "last_pause_ms": self.last_ns / 1e6,
            "collections": {str(g): n for g, n in enumerate(self.collections)},
            "pauses_over_1ms": self.pauses_over_1ms,
        }


watch = GcWatch()
