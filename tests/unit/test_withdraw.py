"""Withdrawn requests, the pure parts: the batch a worker runs without them (workers/withdrawn.py),
the mailbox that notes Withdraws and stamps completions (workers/mailbox.py, over a real inproc
socket pair), and the broker's record of a batch in flight (broker/state/inflight.py, pool.py)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import zmq

from tgw.broker.state.inflight import Gone, Inflight, left_out, take_out
from tgw.broker.state.pending import Pending
from tgw.broker.state.pool import WorkerHandle
from tgw.shm.segment import Segment, new_name
from tgw.shm.wire import Batch, BlockTensor, Done, IOSpec, Release, Withdraw, encode, from_worker_decoder
from tgw.workers.mailbox import Mailbox
from tgw.workers.withdrawn import shrink

X = BlockTensor(name="x", dtype="float32", shape=[6, 2], offset=0, nbytes=48)
_ids = itertools.count(1)


def batch(splits=(2, 1, 3), batch_id: int = 7, **kw) -> Batch:
    return Batch(batch_id=batch_id, model="m", version="1", rows=sum(splits), block=0, inputs=[X],
                 splits=list(splits), **kw)


def pending(rows: int = 1, client=b"c") -> Pending:
    return Pending(client=client, req_id=next(_ids), model="m", version="1", rows=rows, shape_key=(),
                   tensors=[b"\0" * 8 * rows], outputs=["y"], deadline=100.0)


# ---- the worker's smaller batch ------------------------------------------------------------------

def test_shrink_keeps_the_other_requests_rows_in_order():
    s = shrink(batch(traces=["a", "b", "c"]), {1})
    assert (s.batch.rows, s.batch.splits, s.batch.traces, s.withdrawn) == (5, [2, 3], ["a", "c"], [1])
    assert s.runs == [(0, 2), (3, 6)] and s.batch.inputs == [X] and s.batch.batch_id == 7
    x = torch.arange(12.0).reshape(6, 2)
    np.testing.assert_array_equal(s.rows_of(x).numpy(), x.numpy()[[0, 1, 3, 4, 5]])
    assert s.rows_of(["r0", "r1", "r2", "r3", "r4", "r5"]) == ["r0", "r1", "r3", "r4", "r5"]


def test_shrink_of_one_run_is_a_view_and_of_everything_is_empty():
    s = shrink(batch(), {0, 1})
    x = torch.arange(12.0).reshape(6, 2)
    kept = s.rows_of(x)
    assert s.runs == [(3, 6)] and kept.data_ptr() == x[3].data_ptr()   # a view: no copy
    none = shrink(batch(cuda_outputs=[{}, {}, {}]), {0, 1, 2})
    assert (none.batch.rows, none.batch.splits, none.batch.cuda_outputs, none.runs) == (0, [], [], [])
    assert none.rows_of(x).shape == (0, 2)


def test_shrink_ignores_indices_that_are_no_request_of_the_batch():
    assert shrink(batch(), {5, -1}) is None
    assert shrink(batch(), set()) is None


# ---- the worker's mailbox --------------------------------------------------------------------

@pytest.fixture
def pair():
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://mailbox")
    b.connect("inproc://mailbox")
    yield a, b
    a.close(0)
    b.close(0)
    ctx.term()


def test_mailbox_notes_withdrawals_for_batches_not_launched_and_ignores_late_ones(pair):
    broker, worker = pair
    mail = Mailbox(worker)
    for msg in (batch(batch_id=3), Withdraw(batch_id=3, requests=[0]), batch(batch_id=4),
                Withdraw(batch_id=4, requests=[1]), Release(blocks=[64])):
        broker.send(encode(msg))
    assert mail.next().batch_id == 3 and mail.arrived(5000)
    mail.look_ahead()   # batch 4, its Withdraw (noted, not parked), the Release
    assert [type(m).__name__ for m in mail.parked] == ["Batch", "Release"]
    assert mail.launch(3) == {0} and mail.launch(4) == {1}
    broker.send(encode(Withdraw(batch_id=4, requests=[2])))   # batch 4 launched already: too late
    assert type(mail.next()).__name__ == "Batch" and type(mail.next()).__name__ == "Release"
    assert type(mail.next()) is Withdraw and mail.withdrawn == {}


def test_mailbox_stamps_every_part_of_a_shrunk_batch_until_its_final_one(pair):
    broker, worker = pair
    mail = Mailbox(worker)
    mail.report(9, [1, 4])
    mail.send(Done(batch_id=9, first=0, count=2, final=False))
    mail.send(Done(batch_id=8))
    mail.send(Done(batch_id=9, first=2, count=0))
    mail.send(Done(batch_id=9))   # a later batch with the same id never comes; nothing stamped now
    got = [from_worker_decoder.decode(broker.recv()) for _ in range(4)]
    assert [d.withdrawn for d in got] == [[1, 4], [], [1, 4], []]


# ---- the broker's batch in flight ------------------------------------------------------------

def test_take_out_marks_places_gone_and_asks_only_before_any_part():
    ps = [pending(2), pending(1, client=b"x"), pending(3), pending(1, client=b"x")]
    b = Inflight(7, "m", "m:1", list(ps), 0, 7)
    hits, ask = take_out(b, lambda p: p.client == b"x")
    assert hits == [ps[1], ps[3]] and ask == Withdraw(batch_id=7, requests=[1, 3])
    assert b.requests == [ps[0], ps[2]] and [type(e) for e in b.order] == [Pending, Gone, Pending, Gone]
    assert take_out(b, lambda p: p.client == b"x") == ([], None)   # withdrawn once
    b.answered = 1
    hits, ask = take_out(b, lambda p: p is ps[2])
    assert hits == [ps[2]] and ask is None   # a part came: the worker has launched it


def test_left_out_removes_the_places_the_worker_took_out():
    ps = [pending(2), pending(1), pending(3)]
    b = Inflight(7, "m", "m:1", list(ps), 0, 6)
    take_out(b, lambda p: p is ps[1])
    out = left_out(b, [1, 9])
    assert [e.request for e in out] == [ps[1]] and b.order == [ps[0], ps[2]] and b.rows == 5 and b.reported


@pytest.fixture
def handle():
    seg = Segment.create(new_name("ring"), 128 << 10)
    try:
        yield WorkerHandle(worker_id=0, device="cpu", cpus=[], segment=seg, input_bytes=64 << 10,
                           output_bytes=64 << 10)
    finally:
        try:
            seg.close()
        finally:
            seg.unlink()


def completion(handle: WorkerHandle, rows: np.ndarray, **kw) -> Done:
    """A completion whose output y (rows x 1 float32) lies at the output arena's start."""
    at = handle.input_bytes
    handle.segment.buf[at:at + rows.nbytes] = rows.tobytes()
    return Done(batch_id=5, outputs=[BlockTensor(name="y", dtype="float32", shape=[len(rows), 1], offset=at,
                                                 nbytes=rows.nbytes)], block=0, **kw)


def rows_of(handle: WorkerHandle, done: Done, inflight, part) -> list:
    out = []
    for p, views in handle.output_rows(done, inflight, part):
        t, view = views["y"]
        out.append((p, np.frombuffer(view, np.float32).tolist()))
        del view, views
    return out


def test_a_shrunk_batchs_completion_answers_the_kept_requests_with_their_rows(handle):
    ps = [pending(1), pending(2), pending(1)]
    handle.stage(5, list(ps), [IOSpec(name="x", dtype="float32", shape=[2])])
    _, ask = take_out(handle.inflight[5], lambda p: p is ps[1])
    assert ask.requests == [1]
    done = completion(handle, np.array([[10.0], [30.0]], np.float32), withdrawn=[1])   # the worker left it out
    b, part, dropped = handle.take_part(done)
    assert [e.request for e in dropped] == [ps[1]] and b.rows == 2 and 5 not in handle.inflight
    assert rows_of(handle, done, b, part) == [(ps[0], [10.0]), (ps[2], [30.0])]


def test_a_launched_batchs_completion_carries_the_withdrawn_rows_to_drop(handle):
    ps = [pending(1), pending(2), pending(1)]
    handle.stage(5, list(ps), [IOSpec(name="x", dtype="float32", shape=[2])])
    take_out(handle.inflight[5], lambda p: p is ps[1])
    done = completion(handle, np.array([[1.0], [2.0], [2.5], [3.0]], np.float32))   # too late: computed
    b, part, dropped = handle.take_part(done)
    got = rows_of(handle, done, b, part)
    assert dropped == [] and [type(p) for p, _ in got] == [Pending, Gone, Pending]
    assert got[0] == (ps[0], [1.0]) and got[2] == (ps[2], [3.0]) and got[1][1] == [2.0, 2.5]
