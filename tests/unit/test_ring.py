"""RingAllocator (shm/ring.py): alignment, bounds, no overlap, ring order, wrap-around,
out-of-order release, and the errors for impossible requests and bad releases."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tgw.shm.ring import ALIGN, BlockTooLarge, RingAllocator, align_up


# ---- a reference model of ring-order semantics ------------------------------------------------

class RingModel:
    """Blocks in allocation order; space is reclaimed only from the oldest block forward."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.blocks: list[list] = []  # [offset, size, released], oldest first, unreclaimed only

    @property
    def live(self) -> dict[int, int]:
        return {o: s for o, s, r in self.blocks if not r}

    def gaps(self) -> list[tuple[int, int]]:
        """Free [start, end) regions a new block may take without passing the oldest block."""
        if not self.blocks:
            return [(0, self.capacity)]
        tail = self.blocks[0][0]
        head = self.blocks[-1][0] + self.blocks[-1][1]
        if head > tail:
            return [(head, self.capacity), (0, tail)]
        return [(head, tail)]

    def fits(self, size: int) -> bool:
        return any(end - start >= size for start, end in self.gaps())

    def add(self, offset: int, size: int) -> None:
        self.blocks.append([offset, size, False])

    def release(self, offset: int) -> None:
        for b in self.blocks:
            if b[0] == offset and not b[2]:
                b[2] = True
                break
        else:
            raise AssertionError("model: not live")
        while self.blocks and self.blocks[0][2]:
            self.blocks.pop(0)


def overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[0] + b[1] and b[0] < a[0] + a[1]


class RingMachine(RuleBasedStateMachine):
    """Random alloc / out-of-order release sequences against the model."""

    @initialize(blocks=st.integers(1, 24))
    def setup(self, blocks: int):
        self.capacity = blocks * ALIGN
        self.ring = RingAllocator(self.capacity)
        self.model = RingModel(self.capacity)
        self.wraps = 0

    @rule(nbytes=st.one_of(st.integers(0, 24 * ALIGN), st.integers(1, 24).map(lambda k: k * ALIGN)))
    def alloc(self, nbytes: int):
        self._alloc(nbytes)

    @rule(data=st.data())
    def alloc_exact_gap(self, data):
        """Sizes at the edges of a ring-order gap: exactly its length, one block more or less."""
        start, end = data.draw(st.sampled_from(self.model.gaps()))
        n = data.draw(st.sampled_from([end - start, end - start - 1, end - start + 1, end - start + ALIGN,
                                       end - start - ALIGN]))
        self._alloc(max(n, 0))

    def _alloc(self, nbytes: int):
        size = align_up(max(nbytes, 1))
        if size > self.capacity:
            with pytest.raises(BlockTooLarge):
                self.ring.alloc(nbytes)
            return
        unreclaimed = [(o, s) for o, s, _ in self.model.blocks]
        fits = self.model.fits(size)
        off = self.ring.alloc(nbytes)
        if off is None:
            assert not fits, f"alloc({nbytes}) returned None but ring-order gaps {self.model.gaps()} fit {size}"
            return
        assert fits
        assert off % ALIGN == 0
        assert 0 <= off and off + size <= self.capacity
        # never hands out space that the oldest unreclaimed block still guards
        assert not any(overlaps((off, size), b) for b in unreclaimed)
        if self.model.blocks and off < self.model.blocks[-1][0]:
            self.wraps += 1
        self.model.add(off, size)

    @precondition(lambda self: self.model.live)
    @rule(data=st.data())
    def release(self, data):
        off = data.draw(st.sampled_from(sorted(self.model.live)))
        self.ring.release(off)
        self.model.release(off)
        with pytest.raises(KeyError):  # double release
            self.ring.release(off)

    @rule(data=st.data())
    def release_unknown(self, data):
        off = data.draw(st.integers(-ALIGN, self.capacity + ALIGN))
        if off in self.model.live:
            return
        with pytest.raises(KeyError):
            self.ring.release(off)

    @precondition(lambda self: not self.model.live)
    @rule()
    def whole_arena_when_empty(self):
        off = self.ring.alloc(self.capacity)
        assert off == 0
        self.ring.release(off)
        assert self.ring.live() == []
        self.model.blocks.clear()

    @invariant()
    def consistent(self):
        live = self.ring.live()
        assert dict(live) == self.model.live
        assert [o for o, _ in live] == [o for o, _, r in self.model.blocks if not r]  # oldest first
        for i, (o, s) in enumerate(live):
            assert o % ALIGN == 0 and s % ALIGN == 0 and s > 0
            assert 0 <= o and o + s <= self.capacity
            for o2, s2 in live[i + 1:]:
                assert not overlaps((o, s), (o2, s2))
        assert self.ring.live_blocks == len(live)
        assert self.ring.used_bytes == sum(s for _, s in live)

    def teardown(self):
        # Releasing everything, in any order, always gives the whole arena back.
        for off in list(self.model.live):
            self.ring.release(off)
        assert self.ring.live() == []
        assert self.ring.alloc(self.capacity) == 0


RingMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
TestRingStateful = RingMachine.TestCase


# ---- targeted tests ---------------------------------------------------------------------------

def test_alignment_and_sizes():
    r = RingAllocator(64 * 64)
    for n in (0, 1, 63, 64, 65, 127, 128, 1000):
        off = r.alloc(n)
        assert off is not None and off % ALIGN == 0
    sizes = [s for _, s in r.live()]
    assert sizes == [64, 64, 64, 64, 128, 128, 128, 1024]
    offsets = [o for o, _ in r.live()]
    assert offsets == sorted(offsets) and offsets[0] == 0  # ring order: contiguous from 0
    assert all(o + s == o2 for (o, s), (o2, _) in zip(r.live(), r.live()[1:]))


def test_wrap_around_reuses_offset_zero():
    r = RingAllocator(1024)
    offs = [r.alloc(256) for _ in range(4)]
    assert offs == [0, 256, 512, 768]
    assert r.alloc(1) is None                 # full
    r.release(0)                              # oldest
    assert r.alloc(256) == 0                  # wraps to the start
    assert r.alloc(1) is None                 # head met tail: full again


def test_out_of_order_release_is_reclaimed_when_oldest_goes():
    r = RingAllocator(1024)
    a, b, c, d = (r.alloc(256) for _ in range(4))
    r.release(c)                              # not the oldest: space stays guarded
    r.release(b)
    assert r.alloc(64) is None
    assert r.live() == [(a, 256), (d, 256)]
    r.release(a)                              # oldest: a, b, c reclaimed together
    assert r.live() == [(d, 256)]
    assert r.alloc(768) == 0                  # all of [0, 768) free again
    assert r.alloc(1) is None


def test_wrapped_free_space_is_between_head_and_tail():
    r = RingAllocator(1024)
    blocks = [r.alloc(256) for _ in range(4)]
    r.release(blocks[0])
    w = r.alloc(128)                          # wraps: [0,128)
    assert w == 0
    r.release(blocks[1])                      # tail moves to 512; free [128, 512)
    assert r.alloc(384) == 128
    assert r.alloc(1) is None


def test_no_fit_at_end_falls_back_to_start_only_if_room_before_tail():
    r = RingAllocator(1024)
    a = r.alloc(128)
    b = r.alloc(640)                          # head 768
    r.release(a)                              # tail 128: free [768,1024) and [0,128)
    assert r.alloc(320) is None               # fits in neither gap
    assert r.alloc(192) == 768                # end gap first; 64 bytes stay at the end
    assert r.alloc(192) is None               # neither the 64 at the end nor the 128 before tail
    assert r.alloc(128) == 0                  # wraps, ending exactly at the tail
    assert r.alloc(1) is None                 # the 64 bytes at the end are skipped, not reused
    r.release(b)


def test_end_gap_preferred_over_start():
    r = RingAllocator(1024)
    a = r.alloc(256)
    r.alloc(256)
    r.release(a)
    assert r.alloc(256) == 512                # still room after head: no wrap yet


def test_long_random_run_wraps_and_stays_consistent():
    rng = random.Random(1234)
    cap = 64 * 100
    r, model = RingAllocator(cap), RingModel(cap)
    wraps = 0
    for _ in range(5000):
        if model.live and rng.random() < 0.5:
            off = rng.choice(sorted(model.live))
            r.release(off)
            model.release(off)
        else:
            n = rng.randint(1, 20 * 64)
            size = align_up(n)
            off = r.alloc(n)
            assert (off is not None) == model.fits(size)
            if off is not None:
                if model.blocks and off < model.blocks[-1][0]:
                    wraps += 1
                model.add(off, size)
        assert dict(r.live()) == model.live
    assert wraps > 50


def test_block_too_large():
    r = RingAllocator(1024)
    with pytest.raises(BlockTooLarge):
        r.alloc(1025)
    assert issubclass(BlockTooLarge, ValueError)
    assert r.alloc(1024) == 0                 # exactly the capacity fits an empty arena
    with pytest.raises(BlockTooLarge):        # even while full, too large is told apart from full
        r.alloc(10 ** 9)
    assert r.alloc(1) is None


def test_release_errors():
    r = RingAllocator(1024)
    with pytest.raises(KeyError):
        r.release(0)                          # nothing allocated
    a, b, c = r.alloc(64), r.alloc(64), r.alloc(64)
    with pytest.raises(KeyError):
        r.release(32)                         # inside a block, not its offset
    with pytest.raises(KeyError):
        r.release(4096)
    r.release(b)                              # out of order: pending reclaim
    with pytest.raises(KeyError):
        r.release(b)                          # double release of a pending block
    r.release(a)                              # reclaims a and b
    with pytest.raises(KeyError):
        r.release(a)                          # double release of a reclaimed block
    r.release(c)
    assert r.live() == [] and r.live_blocks == 0 and r.used_bytes == 0


@pytest.mark.parametrize("capacity", [0, -64, 1, 63, 100, 65])
def test_capacity_validation(capacity):
    with pytest.raises(ValueError):
        RingAllocator(capacity)


def test_smallest_arena():
    r = RingAllocator(64)
    assert r.alloc(64) == 0
    assert r.alloc(1) is None
    r.release(0)
    assert r.alloc(1) == 0
