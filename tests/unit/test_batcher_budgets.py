"""The batcher's byte budgets (broker/sched/batcher.py next_batch): a batch never exceeds the input
or output arena's room beyond its head, each output's alignment counted, an unknown output size
never capping it."""
from __future__ import annotations

import pytest

from batcher_cases import BIG, ids, req
from fake_clock import Clock
from tgw.broker.sched.batcher import Batcher
from tgw.shm.ring import align_up, aligned_total


@pytest.fixture
def b():
    bt = Batcher(clock=Clock())
    bt.add_model("m", max_batch_size=8, max_queue=10)
    return bt


def test_max_bytes_budget(b):
    # two inputs per request: 100 and 10 bytes per row -> aligned regions per input
    ps = [req(rows=1, nbytes=(100, 10)) for _ in range(6)]
    for p in ps:
        b.push(p)
    budget = aligned_total([300, 30])            # room for three requests
    assert budget == align_up(300) + align_up(30)
    batch = b.next_batch("m", budget)
    assert len(batch) == 3
    sizes = [sum(p.nbytes[k] for p in batch) for k in range(2)]
    assert aligned_total(sizes) <= budget
    assert ids(batch) == ids(ps[:3])
    assert ids(b.next_batch("m", budget)) == ids(ps[3:])


@pytest.mark.parametrize("budget", [64, 128, 200, 256, 320, 1000])
def test_max_bytes_never_exceeded_beyond_head(b, budget):
    ps = [req(rows=1, nbytes=(40, 24)) for _ in range(8)]
    for p in ps:
        b.push(p)
    seen = []
    while b.queued("m"):
        batch = b.next_batch("m", budget)
        assert batch
        sizes = [sum(p.nbytes[k] for p in batch) for k in range(2)]
        if len(batch) > 1:
            assert aligned_total(sizes) <= budget
        seen += ids(batch)
    assert seen == ids(ps)


def test_head_over_budget_still_returned(b):
    big = req(nbytes=(4096,))
    b.push(big)
    b.push(req(nbytes=(16,)))
    assert ids(b.next_batch("m", 64)) == [big.req_id]  # the caller answers it
    assert b.queued("m") == 1


def test_output_budget_caps_the_batch(b):
    # small inputs, large outputs: two declared outputs of 1000 and 8 bytes per row
    ps = [req(rows=r, out=(1000, 8)) for r in (1, 2, 1, 3, 1)]
    for p in ps:
        b.push(p)
    cap = aligned_total([4000, 32])               # room for four rows of outputs
    batches = []
    while b.queued("m"):
        batch = b.next_batch("m", BIG, cap)
        outs = [sum(p.out_nbytes[k] for p in batch) for k in range(2)]
        assert aligned_total(outs) <= cap
        batches.append(ids(batch))
    # 1 + 2 + 1 rows fill it; the 3-row request would overflow it: it heads the next batch
    assert batches == [ids(ps[:3]), ids(ps[3:])]


def test_output_budget_counts_each_outputs_alignment(b):
    # 4 rows x 15 bytes = 60 fit one 64-byte region per output, 5 rows (75 bytes) need 128
    for _ in range(8):
        b.push(req(out=(15, 15)))
    assert len(b.next_batch("m", BIG, 128)) == 4
    assert len(b.next_batch("m", BIG, 256)) == 4


def test_unknown_output_size_is_not_capped(b):
    ps = [req(out=None) for _ in range(5)]        # a -1 output dim: the worker splits if needed
    for p in ps:
        b.push(p)
    assert ids(b.next_batch("m", BIG, 64)) == ids(ps)


def test_head_over_output_budget_still_returned(b):
    big, small = req(out=(4096,)), req(out=(16,))
    b.push(big)
    b.push(small)
    assert ids(b.next_batch("m", BIG, 1024)) == [big.req_id]  # admission normally refuses it
    assert ids(b.next_batch("m", BIG, 1024)) == [small.req_id]
