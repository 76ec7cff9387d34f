"""Which version serves a request that names none: a weighted split, sticky per routing key.

The versions' weights lay out adjacent intervals of [0, 1) in version order. A request with a
routing key lands at a stable hash of the key, so one key always gets the same version while
the weights are unchanged, with no per-key state; when weights move, only the keys in the
intervals that moved change version. A request without a key lands at the next point of the
golden-ratio sequence (n * 0.618... mod 1), which visits [0, 1) evenly: over any run of n
requests each version's share is within a few / n of its weight, not just on average.
"""
from __future__ import annotations

import bisect
import hashlib

GOLDEN = 0.6180339887498949
HASH_SCALE = float(1 << 64)


class Traffic:
    def __init__(self, weights: dict[str, int]):
        """`weights`: version -> weight >= 0, in the order their intervals are laid out; the sum
        must be positive (callers validate; an empty dict routes nothing)."""
        self.weights = {v: w for v, w in weights.items() if w > 0}
        total = sum(self.weights.values())
        self.versions = list(self.weights)
        self.edges: list[float] = []   # the upper end of each version's interval
        acc = 0
        for w in self.weights.values():
            acc += w
            self.edges.append(acc / total)
        self._n = 0

    def __bool__(self) -> bool:
        return bool(self.versions)

    def share(self, version: str) -> float:
        total = sum(self.weights.values())
        return self.weights.get(version, 0) / total if total else 0.0

    def pick(self, routing_key: str | None = None) -> str | None:
        """The version for one request; None when no version has weight."""
        versions = self.versions
        if len(versions) <= 1:
            return versions[0] if versions else None
        if routing_key is None:
            self._n += 1
            point = (self._n * GOLDEN) % 1.0
        else:
            digest = hashlib.blake2b(routing_key.encode(), digest_size=8).digest()
            point = int.from_bytes(digest, "little") / HASH_SCALE
        return versions[min(bisect.bisect_right(self.edges, point), len(versions) - 1)]
