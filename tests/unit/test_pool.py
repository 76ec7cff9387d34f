"""WorkerHandle (broker/state/pool.py) over a real segment: staging copies each input's rows
contiguously at 64-byte-aligned regions and describes them in a Batch; finish() frees the
input block; output_rows() slices each request's rows out of a completion."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from tgw.broker.state.pending import Pending
from tgw.broker.state.pool import IllegalTransition, WorkerHandle, WorkerState
from tgw.shm.ring import ALIGN, align_up
from tgw.shm.segment import Segment, new_name
from tgw.shm.views import block_view
from tgw.shm.wire import BlockTensor, Done, IOSpec

IN_BYTES = OUT_BYTES = 64 << 10
TWO_INPUTS = [IOSpec(name="a", dtype="float32", shape=[3]), IOSpec(name="b", dtype="int64", shape=[2])]
ONE_INPUT = [IOSpec(name="x", dtype="float32", shape=[3])]
VAR_INPUT = [IOSpec(name="x", dtype="float32", shape=[-1])]


@pytest.fixture
def handle():
    seg = Segment.create(new_name("ring"), IN_BYTES + OUT_BYTES)
    try:
        yield WorkerHandle(worker_id=0, device="cpu", cpus=[], segment=seg, input_bytes=IN_BYTES,
                           output_bytes=OUT_BYTES)
    finally:
        try:
            seg.close()
        finally:
            seg.unlink()


_ids = itertools.count(1)


def request(arrays: list[np.ndarray], deadline: float = 100.0, shape_key: tuple = ()) -> Pending:
    """A request carrying these arrays (declared input order) as raw bytes, like received frames."""
    return Pending(client=b"c", req_id=next(_ids), model="m", version="1", rows=len(arrays[0]),
                   shape_key=shape_key, tensors=[a.tobytes() for a in arrays], outputs=["y"],
                   deadline=deadline)


def two_input_request(rows: int, seed: int, **kw) -> tuple[Pending, list[np.ndarray]]:
    arrays = [np.arange(rows * 3, dtype=np.float32).reshape(rows, 3) + seed,
              np.arange(rows * 2, dtype=np.int64).reshape(rows, 2) * seed]
    return request(arrays, **kw), arrays


def arena(h: WorkerHandle, t: BlockTensor) -> np.ndarray:
    """A copy of what a BlockTensor describes in the segment (no view outlives the call)."""
    return block_view(h.segment.buf, t).copy()


def big_request() -> Pending:
    """One request filling more than half the input arena."""
    return request([np.zeros((IN_BYTES * 5 // 8 // 12, 3), dtype=np.float32)])


# ---- staging -----------------------------------------------------------------------------------

def test_stage_copies_rows_contiguously_in_request_order(handle):
    reqs = [two_input_request(rows, seed) for rows, seed in ((2, 10), (1, 20), (3, 30))]
    batch = handle.stage(7, [p for p, _ in reqs], TWO_INPUTS)
    assert (batch.batch_id, batch.model, batch.version, batch.rows, batch.block) == (7, "m", "1", 6, 0)
    a, b = batch.inputs
    assert (a.name, a.dtype, a.shape, a.offset, a.nbytes) == ("a", "float32", [6, 3], 0, 6 * 3 * 4)
    assert (b.name, b.dtype, b.shape, b.offset, b.nbytes) == ("b", "int64", [6, 2], align_up(6 * 3 * 4), 6 * 2 * 8)
    for k, t in enumerate(batch.inputs):
        assert t.offset % ALIGN == 0
        np.testing.assert_array_equal(arena(handle, t), np.concatenate([arrays[k] for _, arrays in reqs]))
    assert handle.inflight[7].requests == [p for p, _ in reqs] and handle.inflight[7].rows == 6


def test_second_batch_follows_the_first_aligned(handle):
    first = handle.stage(1, [two_input_request(1, 1)[0]], TWO_INPUTS)
    p, arrays = two_input_request(2, 5)
    second = handle.stage(2, [p], TWO_INPUTS)
    assert second.block == first.block + align_up(12) + align_up(16)
    for t, want in zip(second.inputs, arrays):
        assert t.offset % ALIGN == 0 and t.offset >= second.block
        np.testing.assert_array_equal(arena(handle, t), want)


def test_batch_deadline_is_the_latest_request_deadline(handle):
    reqs = [two_input_request(1, s, deadline=d)[0] for s, d in ((1, 50.0), (2, 70.5), (3, 60.0))]
    assert handle.stage(1, reqs, TWO_INPUTS).deadline == 70.5


def test_queued_releases_ride_on_the_next_batch_only(handle):
    handle.releases += [128, 4096]
    assert handle.stage(1, [two_input_request(1, 1)[0]], TWO_INPUTS).release == [128, 4096]
    assert handle.releases == []
    assert handle.stage(2, [two_input_request(1, 1)[0]], TWO_INPUTS).release == []


def test_variable_shape_batch_takes_its_shape_from_shape_key(handle):
    arrays = [np.full((2, 5), 1.5, dtype=np.float32), np.full((1, 5), -2.0, dtype=np.float32)]
    reqs = [request([a], shape_key=((5,),)) for a in arrays]
    (x,) = handle.stage(3, reqs, VAR_INPUT).inputs
    assert x.shape == [3, 5] and x.nbytes == 3 * 5 * 4
    np.testing.assert_array_equal(arena(handle, x), np.concatenate(arrays))


# ---- input arena space -------------------------------------------------------------------------

def test_full_input_arena_refuses_until_finish_frees_a_block(handle):
    running, waiting = big_request(), big_request()
    first = handle.stage(1, [running], ONE_INPUT)
    handle.releases.append(64)
    assert handle.stage(2, [waiting], ONE_INPUT) is None
    assert list(handle.inflight) == [1] and handle.releases == [64]   # a refused stage changes nothing
    finished = handle.finish(Done(batch_id=1))
    assert (finished.batch_id, finished.block, finished.requests) == (1, first.block, [running])
    assert handle.inputs.live() == []
    again = handle.stage(2, [waiting], ONE_INPUT)
    assert again is not None and again.release == [64] and list(handle.inflight) == [2]


def test_finish_of_an_unknown_batch_is_none_and_frees_nothing(handle):
    handle.stage(1, [two_input_request(1, 1)[0]], TWO_INPUTS)
    live = handle.inputs.live()
    assert handle.finish(Done(batch_id=99)) is None
    assert handle.inputs.live() == live and list(handle.inflight) == [1]
    assert handle.finish(Done(batch_id=1)).batch_id == 1
    assert handle.finish(Done(batch_id=1)) is None   # a second completion of the same batch


# ---- output slicing ----------------------------------------------------------------------------

def write_outputs(h: WorkerHandle, block: int, arrays: dict[str, np.ndarray]) -> list[BlockTensor]:
    """Lay outputs in the output arena as a worker does; offsets are absolute in the segment."""
    tensors, pos = [], IN_BYTES + block
    for name, a in arrays.items():
        h.segment.buf[pos:pos + a.nbytes] = a.tobytes()
        tensors.append(BlockTensor(name=name, dtype=a.dtype.name, shape=list(a.shape), offset=pos, nbytes=a.nbytes))
        pos += align_up(a.nbytes)
    return tensors


def test_output_rows_slices_each_requests_rows(handle):
    reqs = [two_input_request(rows, 1)[0] for rows in (2, 1, 3)]
    handle.stage(5, reqs, TWO_INPUTS)
    outs = {"y": np.arange(6 * 2, dtype=np.float32).reshape(6, 2), "z": np.arange(6, dtype=np.int64) * 7}
    done = Done(batch_id=5, outputs=write_outputs(handle, 256, outs), block=256)
    inflight = handle.finish(done)
    got, row = [], 0
    for p, views in handle.output_rows(done, inflight):
        assert sorted(views) == ["y", "z"]
        for name, (t, view) in views.items():
            assert t.name == name
            rows = np.frombuffer(view, dtype=t.dtype).reshape(p.rows, *t.shape[1:])
            np.testing.assert_array_equal(rows, outs[name][row:row + p.rows])
            del rows, view
        got.append(p)
        row += p.rows
        del views
    assert got == reqs


def test_worker_state_moves_only_along_its_life_cycle(handle):
    assert handle.state is WorkerState.PLANNED
    with pytest.raises(IllegalTransition):
        handle.became_ready(["m:1"])                 # not spawned yet
    handle.spawned(None)
    handle.became_ready(["m:1"])
    assert handle.state is WorkerState.READY and handle.can_take("m:1", 2) and not handle.can_take("m:2", 2)
    with pytest.raises(IllegalTransition):
        handle.renew(handle.segment)                 # only a dead worker gets a next life
    handle.exited()
    assert not handle.can_take("m:1", 2)
    identity = handle.identity
    handle.renew(handle.segment)
    assert handle.identity != identity and handle.models == set() and handle.inflight == {}
    handle.spawned(None)
    handle.told_to_stop()
    with pytest.raises(IllegalTransition):
        handle.became_ready(["m:1"])                 # a late ready does not undo a stop
    handle.exited()
    assert handle.state is WorkerState.DEAD
