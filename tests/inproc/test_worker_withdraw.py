"""A worker's batch with requests withdrawn before launch (workers/serve.py, withdrawn.py), in
process: a real Server over an inproc socket pair, a real segment and a TorchScript model
(y = 2x). The Withdraw is on the socket when the batch launches, as when it was sent while the
batch waited behind another; the batch runs without those rows and says so (Done.withdrawn)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import zmq

from models import MODELS, save
from tgw.shm.segment import Segment, new_name
from tgw.shm.views import block_view
from tgw.shm.wire import Batch, BlockTensor, Done, IOSpec, ModelSpec, Withdraw, encode, from_worker_decoder
from tgw.workers.runner import ModelRunner
from tgw.workers.serve import Server

IN_BYTES = OUT_BYTES = 64 << 10


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> ModelRunner:
    path = str(tmp_path_factory.mktemp("withdraw") / "double.pt")
    save("double", path)
    decl = MODELS["double"][1]
    return ModelRunner(ModelSpec(name="double", version="1", path=path,
                                 **{k: [IOSpec(**t) for t in decl[k]] for k in ("inputs", "outputs")}),
                       torch.device("cpu"))


@pytest.fixture
def rig(runner):
    segment = Segment.create(new_name("ring"), IN_BYTES + OUT_BYTES)
    ctx = zmq.Context()
    broker, worker = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    broker.bind("inproc://withdraw")
    worker.connect("inproc://withdraw")
    server = Server(worker, segment, IN_BYTES, OUT_BYTES, {runner.key: runner})
    try:
        yield server, broker, segment
    finally:
        server.close()
        broker.close(0)
        worker.close(0)
        ctx.term()
        segment.close()
        segment.unlink()


def staged(segment: Segment, splits: list[int], batch_id: int = 3) -> tuple[Batch, np.ndarray]:
    """A batch of requests with these rows (x: [rows, 2], row r = [r, r + 0.5]) in the input arena."""
    rows = sum(splits)
    x = np.stack([np.arange(rows, dtype=np.float32), np.arange(rows, dtype=np.float32) + 0.5], axis=1)
    segment.buf[0:x.nbytes] = x.tobytes()
    return Batch(batch_id=batch_id, model="double", version="1", rows=rows, block=0, splits=splits,
                 inputs=[BlockTensor(name="x", dtype="float32", shape=[rows, 2], offset=0, nbytes=x.nbytes)]), x


def run(server: Server, broker: zmq.Socket, batch: Batch) -> Done:
    """The batch run, its completion sent as the serving loop sends it, and received."""
    server.mail.send(server.run_batch(batch))
    assert broker.poll(5000)
    return from_worker_decoder.decode(broker.recv())


def output(segment: Segment, done) -> np.ndarray:
    (t,) = done.outputs
    return block_view(segment.buf, t).copy()


def test_withdrawn_requests_rows_are_left_out_and_the_rest_exact(rig):
    server, broker, segment = rig
    batch, x = staged(segment, [2, 1, 3, 1])
    broker.send(encode(Withdraw(batch_id=3, requests=[1, 3])))
    assert server.mail.arrived(5000)
    done = run(server, broker, batch)
    assert done.error is None and done.withdrawn == [1, 3]
    kept = x[[0, 1, 3, 4, 5]]
    np.testing.assert_array_equal(output(segment, done), kept * 2)


def test_a_batch_withdrawn_whole_computes_nothing(rig):
    server, broker, segment = rig
    batch, _ = staged(segment, [1, 2])
    broker.send(encode(Withdraw(batch_id=3, requests=[0, 1])))
    assert server.mail.arrived(5000)
    done = run(server, broker, batch)
    assert (done.error, done.outputs, done.block, done.withdrawn) == (None, [], None, [0, 1])


def test_a_withdraw_for_a_batch_already_launched_is_ignored(rig):
    server, broker, segment = rig
    batch, x = staged(segment, [1, 1])
    first = run(server, broker, batch)
    broker.send(encode(Withdraw(batch_id=3, requests=[0])))   # too late for batch 3
    assert server.mail.arrived(5000)
    later, _ = staged(segment, [1], batch_id=4)
    done = run(server, broker, later)
    assert first.withdrawn == [] and done.withdrawn == [] and server.mail.withdrawn == {}
    np.testing.assert_array_equal(output(segment, first), x * 2)
