"""A first-fit free list over one span of bytes, 64-byte aligned: the client's shared-memory
regions (client/regions.py) and a front process's region (broker/fronts/region.py) place
tensors with it. Not thread-safe: a caller with threads holds its own lock around it."""
from __future__ import annotations

import bisect

from .ring import align_up


class Extents:
    __slots__ = ("free",)

    def __init__(self, nbytes: int):
        self.free = [[0, nbytes]]     # free extents [start, end), by start

    def take(self, n: int) -> int | None:
        """The offset of `n` bytes (rounded up to the alignment) now taken; None: no room."""
        n = align_up(n)
        for ext in self.free:
            if ext[1] - ext[0] >= n:
                at = ext[0]
                ext[0] += n
                if ext[0] == ext[1]:
                    self.free.remove(ext)
                return at
        return None

    def give(self, at: int, n: int) -> None:
        """[at, at + n) back to the free list, merged with its neighbours."""
        end, free = at + align_up(n), self.free
        i = bisect.bisect_left(free, [at, at])
        if i < len(free) and free[i][0] == end:          # joins the next extent
            free[i][0] = at
            if i > 0 and free[i - 1][1] == at:           # and the previous one
                free[i - 1][1] = free[i][1]
                del free[i]
        elif i > 0 and free[i - 1][1] == at:
            free[i - 1][1] = end
        else:
            free.insert(i, [at, end])

    def free_bytes(self) -> int:
        return sum(e - s for s, e in self.free)
