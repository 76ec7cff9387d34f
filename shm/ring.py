"""Ring allocator for one arena of a worker's segment.

Writer allocates, reader releases (docs/ARCHITECTURE.md, "The shared-memory ring"): the allocator's state lives only in
the writer's process; the reader's releases reach it as messages on the socket, so no
cross-process lock or flag lives in shared memory. Blocks are 64-byte aligned, allocated
in ring order, released in any order; space is reclaimed from the oldest block forward.
"""
from __future__ import annotations

from collections import deque

ALIGN = 64


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) & ~(align - 1)


def aligned_total(sizes) -> int:
    """Bytes of one block holding regions of these sizes, each starting 64-byte aligned."""
    return sum([(s + ALIGN - 1) & -ALIGN for s in sizes])  # align_up inlined: on the broker's hot path


def region_offsets(sizes) -> list[int]:
    """Where each region starts inside such a block (the layout both writers use)."""
    offsets, pos = [], 0
    for s in sizes:
        offsets.append(pos)
        pos += align_up(s)
    return offsets


class BlockTooLarge(ValueError):
    """The request can never fit in this arena, however much is released."""


class RingAllocator:
    def __init__(self, capacity: int):
        if capacity <= 0 or capacity % ALIGN:
            raise ValueError(f"arena capacity must be a positive multiple of {ALIGN}, got {capacity}")
        self.capacity = capacity
        self._order: deque[int] = deque()   # live block offsets, oldest first
        self._size: dict[int, int] = {}     # offset -> aligned size, live blocks
        self._released: set[int] = set()    # released but not yet reclaimed (not oldest)
        self._head = 0                      # next free byte after the newest block
        self.in_use = 0                     # bytes of unreleased blocks (an int: another thread may read it)

    @property
    def live_blocks(self) -> int:
        return len(self._order) - len(self._released)

    @property
    def used_bytes(self) -> int:
        return self.in_use

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a new block of at least `nbytes`, or None while the arena is full."""
        size = align_up(max(nbytes, 1))
        if size > self.capacity:
            raise BlockTooLarge(f"{nbytes} bytes can never fit in an arena of {self.capacity} bytes")
        if not self._order:
            offset = 0
        else:
            tail, head = self._order[0], self._head
            if head > tail:          # live data in [tail, head): free at the end, then the start
                if head + size <= self.capacity:
                    offset = head
                elif size <= tail:
                    offset = 0
                else:
                    return None
            elif head < tail:        # wrapped: free space is [head, tail)
                if head + size > tail:
                    return None
                offset = head
            else:                    # head == tail with live blocks: full
                return None
        self._order.append(offset)
        self._size[offset] = size
        self._head = offset + size
        self.in_use += size
        return offset

    def release(self, offset: int) -> None:
        if offset not in self._size or offset in self._released:
            raise KeyError(f"block at offset {offset} is not allocated")
        self._released.add(offset)
        self.in_use -= self._size[offset]
        while self._order and self._order[0] in self._released:
            oldest = self._order.popleft()
            self._released.discard(oldest)
            del self._size[oldest]
        if not self._order:
            self._head = 0

    def live(self) -> list[tuple[int, int]]:
        """(offset, size) of each unreleased block, oldest first - for tests and debugging."""
        return [(o, self._size[o]) for o in self._order if o not in self._released]
