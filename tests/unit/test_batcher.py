"""Batcher (broker/sched/batcher.py) with an injected clock: FIFO, max_batch_size rows, groups of
version and shape, OVERLOADED with requeue at the front, deadlines, model rotation (the byte
budgets: test_batcher_budgets.py)."""
from __future__ import annotations

import pytest

from batcher_cases import BIG, ids, req
from fake_clock import Clock
from tgw.broker.sched.batcher import Batcher
from tgw.shm.errors import Code, TgwError
from tgw.shm.ring import aligned_total, region_offsets


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def b(clock):
    bt = Batcher(clock=clock)
    bt.add_model("m", max_batch_size=8, max_queue=10)
    return bt



def test_empty(b):
    assert b.next_batch("m", BIG) == []
    assert b.queued() == 0 and b.queued("m") == 0
    assert b.models_with_work() == []
    assert b.expired() == []


def test_fifo(b):
    ps = [req() for _ in range(5)]
    for p in ps:
        b.push(p)
    assert b.queued("m") == 5
    assert ids(b.next_batch("m", BIG)) == ids(ps)
    assert b.queued("m") == 0


def test_fifo_across_batches(b):
    ps = [req(rows=3) for _ in range(6)]   # 8 rows max: two requests per batch
    for p in ps:
        b.push(p)
    out = []
    while b.queued("m"):
        batch = b.next_batch("m", BIG)
        assert sum(p.rows for p in batch) <= 8
        out += ids(batch)
    assert out == ids(ps)


def test_max_batch_size_rows(b):
    rows = [3, 4, 2, 1, 5, 8, 1]
    ps = [req(rows=r) for r in rows]
    for p in ps:
        b.push(p)
    first = b.next_batch("m", BIG)
    # 3 + 4 = 7; 2 would make 9: skipped; 1 makes 8: full
    assert [p.rows for p in first] == [3, 4, 1]
    assert sum(p.rows for p in first) <= 8
    # the skipped request keeps its place at the head
    second = b.next_batch("m", BIG)
    assert [p.rows for p in second] == [2, 5, 1]
    third = b.next_batch("m", BIG)
    assert [p.rows for p in third] == [8]
    assert b.queued("m") == 0


def test_full_head_batch_alone(b):
    b.push(req(rows=8))
    b.push(req(rows=1))
    assert [p.rows for p in b.next_batch("m", BIG)] == [8]
    assert b.queued("m") == 1


def test_overloaded_but_requeue_at_front_always_fits(b):
    ps = [req() for _ in range(10)]
    for p in ps:
        b.push(p)
    extra = req()
    with pytest.raises(TgwError) as info:
        b.push(extra)
    err = info.value
    assert err.code == Code.OVERLOADED and err.http_status == 429 and err.retryable
    assert err.details.get("model") == "m"
    assert b.queued("m") == 10                 # the refused request was not queued
    retry = req()
    b.push(retry, front=True)                  # requeue of an in-flight request: always accepted
    assert b.queued("m") == 11
    batch = b.next_batch("m", BIG)
    assert ids(batch)[0] == retry.req_id
    assert ids(batch)[1:] == ids(ps)[:7]


def test_front_push_order(b):
    a, c = req(), req()
    b.push(a)
    b.push(c, front=True)
    assert ids(b.next_batch("m", BIG)) == [c.req_id, a.req_id]


def test_other_groups_skipped_but_keep_order(b):
    v1a = req(version="1")
    v2a = req(version="2")
    s5 = req(version="1", shape_key=(5,))
    v1b = req(version="1")
    v2b = req(version="2")
    v1c = req(version="1")
    for p in (v1a, v2a, s5, v1b, v2b, v1c):
        b.push(p)
    first = b.next_batch("m", BIG)
    assert ids(first) == [v1a.req_id, v1b.req_id, v1c.req_id]
    assert all(p.group() == ("1", ()) for p in first)
    # the skipped ones are back at the head, in their original order
    assert [p.req_id for p in b.queues["m"].items] == [v2a.req_id, s5.req_id, v2b.req_id]
    second = b.next_batch("m", BIG)
    assert ids(second) == [v2a.req_id, v2b.req_id]
    assert ids(b.next_batch("m", BIG)) == [s5.req_id]


def test_skipped_stay_ahead_of_later_arrivals(b):
    head, other = req(version="1"), req(version="2")
    b.push(head)
    b.push(other)
    b.next_batch("m", BIG)
    later = req(version="1")
    b.push(later)
    assert ids(b.next_batch("m", BIG)) == [other.req_id]
    assert ids(b.next_batch("m", BIG)) == [later.req_id]


def test_aligned_total_and_region_offsets():
    assert aligned_total([]) == 0
    assert aligned_total([1]) == 64
    assert aligned_total([64, 65, 0]) == 64 + 128 + 0
    assert region_offsets([64, 65, 0, 3]) == [0, 64, 192, 192]


def test_expired_removes_exactly_the_due(b, clock):
    deadlines = [1005, 1001, 1010, 1001.5, 1002, 1020]
    ps = [req(deadline=d) for d in deadlines]
    for p in ps:
        b.push(p)
    clock.t = 1002                             # deadline <= now counts as passed
    gone = b.expired()
    assert sorted(p.req_id for p in gone) == sorted(p.req_id for p, d in zip(ps, deadlines) if d <= 1002)
    assert [p.req_id for p in b.queues["m"].items] == [p.req_id for p, d in zip(ps, deadlines) if d > 1002]
    assert b.expired() == []                   # nothing more is due at the same instant
    clock.t = 1100
    assert len(b.expired()) == 3
    assert b.queued() == 0


def test_expired_across_models(clock):
    bt = Batcher(clock=clock)
    bt.add_model("a", 8, 10)
    bt.add_model("b", 8, 10)
    due_a, keep_a = req("a", deadline=999), req("a", deadline=2000)
    due_b = req("b", deadline=1000)
    for p in (due_a, keep_a, due_b):
        bt.push(p)
    assert sorted(p.req_id for p in bt.expired()) == sorted([due_a.req_id, due_b.req_id])
    assert bt.queued("a") == 1 and bt.queued("b") == 0
    assert bt.models_with_work() == ["a"]


def test_models_with_work_rotates(clock):
    bt = Batcher(clock=clock)
    for name in ("a", "b", "c"):
        bt.add_model(name, 8, 10)
        bt.push(req(name))
    firsts = []
    for _ in range(6):
        order = bt.models_with_work()
        assert sorted(order) == ["a", "b", "c"]
        firsts.append(order[0])
    assert set(firsts[:3]) == {"a", "b", "c"}  # each model gets its turn first
    assert firsts[:3] == firsts[3:]            # in a stable cycle


def test_models_with_work_only_lists_queued(clock):
    bt = Batcher(clock=clock)
    for name in ("a", "b", "c", "d"):
        bt.add_model(name, 8, 10)
    bt.push(req("b"))
    bt.push(req("d"))
    firsts = [bt.models_with_work()[0] for _ in range(4)]
    assert all(sorted(bt.models_with_work()) == ["b", "d"] for _ in range(3))
    assert set(firsts) == {"b", "d"}           # both get a turn first within one cycle
    bt.next_batch("b", BIG)
    assert bt.models_with_work() == ["d"]


def test_models_are_independent(clock):
    bt = Batcher(clock=clock)
    bt.add_model("a", 2, 1)
    bt.add_model("b", 4, 1)
    pa, pb = req("a"), req("b")
    bt.push(pa)
    bt.push(pb)                                # a's full queue does not affect b
    with pytest.raises(TgwError):
        bt.push(req("a"))
    assert ids(bt.next_batch("a", BIG)) == [pa.req_id]
    assert ids(bt.next_batch("b", BIG)) == [pb.req_id]


def test_pending_fields():
    p = req(rows=3, nbytes=(4, 8))
    assert p.nbytes == [12, 24]
    assert p.attempts == 0
    assert p.group() == ("1", ())


def test_default_clock_is_monotonic():
    import time
    assert Batcher().clock is time.monotonic


def test_scan_is_bounded_and_keeps_order(clock):
    bt = Batcher(clock=clock)
    bt.add_model("m", 8, 10_000)
    head = req(version="1")
    others = [req(version="2") for _ in range(Batcher.SCAN_LIMIT)]
    far = req(version="1")
    for p in (head, *others, far):
        bt.push(p)
    assert ids(bt.next_batch("m", BIG)) == [head.req_id]      # `far` lies past the scan window
    assert [p.req_id for p in bt.queues["m"].items] == ids(others) + [far.req_id]
