"""Priority levels, aging, shedding and deadline-aware holding in the pure batcher
(broker/sched/batcher.py) under an injected clock and a fed cost model: no processes."""
from __future__ import annotations

import pytest

from fake_clock import Clock
from tgw.broker.sched.batcher import Batcher, Pending
from tgw.broker.sched.costmodel import CostModel
from tgw.shm.errors import Code, TgwError

BIG = 1 << 30
_ids = iter(range(1, 10 ** 9))


def req(clock, priority=0, rows=1, deadline_s=30.0, version="1", model="m") -> Pending:
    return Pending(client=b"c", req_id=next(_ids), model=model, version=version, rows=rows, shape_key=(),
                   tensors=[bytes(16 * rows)], outputs=["y"], deadline=clock() + deadline_s, priority=priority,
                   arrived=clock())


def ids(ps) -> list[int]:
    return [p.req_id for p in ps]


@pytest.fixture
def clock():
    return Clock()


def batcher(clock, costs=None, **policy) -> Batcher:
    b = Batcher(clock, costs or CostModel())
    policy.setdefault("levels", 3)
    b.add_model("m", policy.pop("max_batch_size", 8), policy.pop("max_queue", 100), **policy)
    return b


def test_level_zero_first_fifo_within_a_level(clock):
    b = batcher(clock, max_batch_size=1)
    low1, high1, mid, high2, low2 = (req(clock, 2), req(clock, 0), req(clock, 1), req(clock, 0), req(clock, 2))
    for p in (low1, high1, mid, high2, low2):
        b.push(p)
    order = [b.next_batch("m", BIG)[0] for _ in range(5)]
    assert ids(order) == ids([high1, high2, mid, low1, low2])
    assert b.queued_by_level("m") == [0, 0, 0]


def test_batches_mix_priorities_filled_from_level_zero(clock):
    b = batcher(clock, max_batch_size=3)
    low = [req(clock, 2) for _ in range(3)]
    high = req(clock, 0)
    for p in low + [high]:
        b.push(p)
    assert ids(b.next_batch("m", BIG)) == ids([high, low[0], low[1]])


def test_batches_never_mix_versions_across_levels(clock):
    b = batcher(clock)
    a, other, c = req(clock, 0, version="1"), req(clock, 1, version="2"), req(clock, 2, version="1")
    for p in (a, other, c):
        b.push(p)
    assert ids(b.next_batch("m", BIG)) == ids([a, c])
    assert ids(b.next_batch("m", BIG)) == ids([other])


def test_aging_promotes_a_waiting_request_so_low_levels_do_not_starve(clock):
    costs = CostModel()
    costs.observe("m", 0, 1, 10_000)          # recent batch time 10 ms; aging_batches 2 -> a level per 20 ms
    b = batcher(clock, costs, max_batch_size=1, aging_batches=2)
    old_low = req(clock, 2)
    b.push(old_low)
    clock.t += 0.025                          # 25 ms: one level up (2 -> 1); a fresh level-0 request still wins
    fresh_high = req(clock, 0)
    b.push(fresh_high)
    assert ids(b.next_batch("m", BIG)) == ids([fresh_high])
    clock.t += 0.020                          # 45 ms: two levels up -> effective level 0, older than any level 0
    b.push(req(clock, 0))
    assert ids(b.next_batch("m", BIG)) == ids([old_low])


def test_no_aging_without_a_batch_time(clock):
    b = batcher(clock, max_batch_size=1, aging_batches=1)
    low = req(clock, 2)
    b.push(low)
    clock.t += 3600
    high = req(clock, 0)
    b.push(high)
    assert ids(b.next_batch("m", BIG)) == ids([high])


def test_full_queue_sheds_the_youngest_of_the_lowest_level(clock):
    b = batcher(clock, max_queue=3)
    old2, mid, young2 = req(clock, 2), req(clock, 1), req(clock, 2)
    for p in (old2, mid, young2):
        assert b.push(p) is None
    high = req(clock, 0)
    assert b.push(high) is young2              # the caller answers it OVERLOADED
    assert b.queued("m") == 3
    with pytest.raises(TgwError) as info:       # nothing queued ranks lower than another level-2 request
        b.push(req(clock, 2))
    assert info.value.code is Code.OVERLOADED and info.value.details["reason"] == "queue_full"
    assert b.push(req(clock, 1)) is old2        # a level-1 request still displaces level 2
    assert set(b.queued_by_level("m")) <= {0, 1, 2} and b.queued("m") == 3


def test_expired_takes_requests_their_own_batch_could_not_answer_in_time(clock):
    costs = CostModel()
    costs.observe("m", 0, 1, 50_000)             # a batch of 1 takes 50 ms
    b = batcher(clock, costs)
    tight, loose = req(clock, deadline_s=0.040), req(clock, deadline_s=1.0)
    b.push(tight)
    b.push(loose)
    assert ids(b.expired()) == ids([tight])      # 40 ms left < 50 ms predicted: answered now, not computed
    assert b.queued("m") == 1


def test_work_conserving_without_max_delay(clock):
    b = batcher(clock)
    b.push(req(clock))
    assert b.hold_until("m") is None


def test_holds_to_grow_a_batch_until_max_delay(clock):
    b = batcher(clock, max_delay_us=5000)        # 5 ms
    first = req(clock)
    b.push(first)
    assert b.hold_until("m") == pytest.approx(first.arrived + 0.005)
    clock.t += 0.005
    assert b.hold_until("m") is None             # waited long enough: go


def test_holding_stops_at_a_full_or_preferred_batch(clock):
    b = batcher(clock, max_delay_us=5000, preferred=[4])
    for _ in range(3):
        b.push(req(clock))
    assert b.hold_until("m") is not None
    b.push(req(clock))
    assert b.hold_until("m") is None             # 4 rows: a preferred size


def test_holding_never_breaks_a_deadline(clock):
    costs = CostModel()
    costs.observe("m", 0, 8, 30_000)             # a full batch takes 30 ms
    b = batcher(clock, costs, max_delay_us=100_000)
    p = req(clock, deadline_s=0.050)             # 50 ms left: may wait at most 20 ms
    b.push(p)
    assert b.hold_until("m", 0) == pytest.approx(clock() + 0.020)
    clock.t += 0.021
    assert b.hold_until("m", 0) is None


def test_preferred_sizes_cut_the_batch_at_the_largest_reachable(clock):
    b = batcher(clock, preferred=[2, 4])
    for _ in range(7):
        b.push(req(clock))
    assert len(b.next_batch("m", BIG)) == 4
    assert len(b.next_batch("m", BIG)) == 2
    assert len(b.next_batch("m", BIG)) == 1      # below every preferred size: what there is


def test_next_due_and_expired_heads_answer_the_front_of_each_level_on_time(clock):
    costs = CostModel()
    costs.observe("m", 0, 1, 10_000)             # 10 ms per batch of one
    b = batcher(clock, costs)
    first, second, other = req(clock, deadline_s=0.050), req(clock, deadline_s=0.100), req(clock, 1, deadline_s=0.5)
    for p in (first, second, other):
        b.push(p)
    assert b.next_due() == pytest.approx(clock() + 0.040)   # its deadline less the predicted compute
    clock.t += 0.039
    assert b.expired_heads(clock()) == []
    clock.t += 0.002
    assert ids(b.expired_heads(clock())) == ids([first])
    assert b.next_due() == pytest.approx(clock() - 0.041 + 0.090)
    assert b.queued("m") == 2
