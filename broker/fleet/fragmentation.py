"""Whether a worker keeps memory its models no longer need - a pure judgement over its heartbeats.

Judged only in a life that has unloaded something (a fresh worker holds what it loaded), and
not while a load or unload is under way (memory moves on purpose then). The waste:
 * cuda: reserved less allocated less the largest activation peak of what it holds (the cache a
   batch legitimately keeps between batches) - blocks empty_cache at the unload could not give
   back (a live tensor pins each segment it sits in);
 * cpu: anonymous RSS less the measured weights of what it holds (its level), above the lowest
   level this life has shown since its first unload, less the largest activation peak (one
   batch computes at a time) - the heap malloc keeps. The lowest level seen, not the fresh
   worker's: a process's first load pays one-off costs (torch's JIT, allocator arenas: ~8 MiB
   measured) that stay and are no waste. Anonymous RSS, not RSS: the ring's shared pages grow
   with traffic and come back with nothing.
Past every bound set (MiB, and a share of what the worker holds), for `beats` beats in a row,
it is fragmented: the watch recycles it as it does a leaking one (docs/MEMORY.md).
"""
from __future__ import annotations

from tgw.broker.config.load import FragmentationDecl

MIB = 1 << 20


def need(footprints) -> tuple[int, int]:
    """(weights, largest activation peak) of the footprints of what a worker holds."""
    return sum(fp.weights for fp in footprints), max((fp.activation_peak for fp in footprints), default=0)


def cuda_waste(reserved: int, allocated: int, activation: int) -> tuple[int, int]:
    """(waste, held) on a GPU worker: `allocated` holds the weights, the cache one batch's activations."""
    return max(0, reserved - allocated - activation), reserved


def over_bounds(decl: FragmentationDecl, waste: int, total: int) -> bool:
    """Past every bound set (none set: never)."""
    if not decl.enabled:
        return False
    return (decl.max_mb is None or waste > decl.max_mb * MIB) and \
        (decl.max_share is None or waste > decl.max_share * total)


class FragmentationJudge:
    def __init__(self, decl: FragmentationDecl):
        self.decl = decl
        self.over: dict[bytes, int] = {}     # worker identity (one life) -> beats in a row past the bounds
        self.floor: dict[bytes, int] = {}    # ... -> a CPU worker's lowest level seen since its first unload

    def cpu_waste(self, identity: bytes, rss_anon: int, weights: int, activation: int) -> tuple[int, int]:
        """(waste, held) on a CPU worker; keeps its lowest level."""
        level = rss_anon - weights
        floor = self.floor[identity] = min(self.floor.get(identity, level), level)
        return max(0, level - floor - activation), rss_anon

    def record(self, identity: bytes, waste: int, total: int) -> str:
        """Count this beat; returns why the worker is fragmented, or ""."""
        if not over_bounds(self.decl, waste, total):
            self.over.pop(identity, None)
            return ""
        n = self.over[identity] = self.over.get(identity, 0) + 1
        if n < self.decl.beats:
            return ""
        share = waste / total if total else 0.0
        return f"{waste / MIB:.1f} MiB ({share:.0%} of {total / MIB:.0f} MiB) kept beyond its models' footprints " \
               f"for {n} beats after unloads (bounds max_mb {_bound(self.decl.max_mb)}, " \
               f"max_share {_bound(self.decl.max_share)})"

    def quiet(self, identity: bytes) -> None:
        """Memory moved on purpose (a load, an unload): the beats in a row start again."""
        self.over.pop(identity, None)

    def forget(self, identity: bytes) -> None:
        """A life ended."""
        self.over.pop(identity, None)
        self.floor.pop(identity, None)


def _bound(v: float | None) -> str:
    return "off" if v is None else f"{v:g}"
