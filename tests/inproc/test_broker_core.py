"""The broker's serving core in-process: real Broker, real ZeroMQ sockets over inproc://, a real
ring segment, an injected clock; the test plays both the client and the worker.

Proves without processes or wall-clock races that an expired request is never computed, that a
worker's error reaches the caller with its details, that a lost worker's requests are retried
once, then answered WORKER_DIED, and that a batch answered in parts answers each request once.
"""
from __future__ import annotations

import asyncio
import itertools
import time

import numpy as np
import pytest
import zmq

from conftest import base_config
from rigs import assembled
from tgw.broker.config.load import parse_config
from tgw.broker.state.pool import WorkerHandle, WorkerState
from tgw.broker.core.assembly import assemble
from tgw.shm.errors import Code, TgwError, fail
from tgw.shm.segment import Segment, new_name
from tgw.shm.wire import PROTOCOL_VERSION, Batch, BlockTensor, Done, ErrorReply, Infer, LoadModels, Stats, \
    StatsReply, TensorMeta, WorkerHello, WorkerReady, encode, reply_decoder, to_worker_decoder

X = np.zeros((1, 256), np.float32)
WAIT_S = 10.0
_ports = itertools.count()


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def until(condition, what: str) -> None:
    """Let the broker's loop run until `condition()` holds (bounded)."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.001)


async def recv(sock: zmq.Socket) -> list[bytes]:
    await until(lambda: sock.poll(0), "a message")
    return sock.recv_multipart()


class Rig:
    """A Broker on inproc sockets, one worker handle over a real segment, a client and a fake worker."""

    def __init__(self, cfg, clock: Clock):
        self.ctx = zmq.Context()
        n = next(_ports)
        self.front_addr, self.back_addr = f"inproc://front{n}", f"inproc://back{n}"
        front, back = self.ctx.socket(zmq.ROUTER), self.ctx.socket(zmq.ROUTER)
        front.bind(self.front_addr)
        back.bind(self.back_addr)
        self.broker = assemble(cfg, asyncio.get_running_loop(), front, back, clock=clock)
        self.client = self.ctx.socket(zmq.DEALER)
        self.client.connect(self.front_addr)
        w = cfg.workers
        self.handle = WorkerHandle(0, "cpu", [], Segment.create(new_name("ring"), w.input_bytes + w.output_bytes),
                                   w.input_bytes, w.output_bytes)
        self.worker: zmq.Socket | None = None

    async def next_life(self) -> None:
        """The dead worker's next life, as the supervisor gives it: a fresh ring, then the handshake."""
        self.worker.close(linger=0)
        old = self.handle.segment
        self.handle.renew(Segment.create(new_name("ring"), old.size))
        old.close()
        old.unlink()
        await self.start_worker()

    async def start_worker(self) -> None:
        """Spawn (a new life of) the worker and take it through the handshake."""
        self.handle.spawned(None)
        self.broker.serving.add_worker(self.handle)
        self.worker = self.ctx.socket(zmq.DEALER)
        self.worker.setsockopt(zmq.IDENTITY, self.handle.identity)
        self.worker.connect(self.back_addr)
        self.worker.send(encode(WorkerHello(v=PROTOCOL_VERSION, worker_id=0, pid=4242)))
        load = to_worker_decoder.decode((await recv(self.worker))[0])
        assert isinstance(load, LoadModels) and [m.name for m in load.models] == ["mlp"]
        self.worker.send(encode(WorkerReady(worker_id=0, models=["mlp:1"])))
        await until(lambda: self.handle.state is WorkerState.READY, "the worker to be ready")

    def infer(self, req_id: int, timeout_ms: int) -> None:
        header = Infer(v=PROTOCOL_VERSION, id=req_id, model="mlp", timeout_ms=timeout_ms,
                       inputs=[TensorMeta(name="x", dtype="float32", shape=list(X.shape))])
        self.client.send_multipart([encode(header), X.tobytes()])

    async def reply(self):
        return reply_decoder.decode((await recv(self.client))[0])

    async def batch(self) -> Batch:
        msg = to_worker_decoder.decode((await recv(self.worker))[0])
        assert isinstance(msg, Batch)
        return msg

    async def stats(self) -> dict:
        """The broker's stats; its reply also proves that what was scheduled before it has run."""
        self.client.send(encode(Stats(v=PROTOCOL_VERSION, id=999)))
        reply = await self.reply()
        assert isinstance(reply, StatsReply)
        return reply.models["mlp"]

    def close(self) -> None:
        self.broker.close()
        self.ctx.destroy(linger=0)
        self.handle.segment.close()
        self.handle.segment.unlink()


def run(model_files, scenario, **server):
    cfg = parse_config(base_config(model_files, "mlp", server=server), base_dir="/", source="test")

    async def main():
        rig = Rig(cfg, Clock())
        try:
            await rig.start_worker()
            await scenario(rig, rig.broker.clock)
        finally:
            rig.close()

    asyncio.run(main())


@pytest.mark.parametrize("sweep", [True, False], ids=["swept-by-tick", "dropped-at-dispatch"])
def test_expired_request_is_never_computed(model_files, sweep):
    async def scenario(rig: Rig, clock: Clock):
        rig.infer(1, timeout_ms=60_000)
        first = await rig.batch()                    # computing on the (test's) worker
        rig.infer(2, timeout_ms=100)                 # one batch in flight per worker: this one queues
        assert (await rig.stats())["queued"] == 1
        clock.t += 1.0                               # its deadline passes while queued
        if sweep:
            rig.broker.tick(clock())
            err = await rig.reply()
            assert isinstance(err, ErrorReply) and err.id == 2 and err.error.code == "DEADLINE_EXCEEDED"
        body = fail(Code.MODEL_EXECUTION_ERROR, "boom", exception="ValueError").to_body()
        rig.worker.send(encode(Done(batch_id=first.batch_id, error=body)))
        replies = {r.id: r for r in [await rig.reply() for _ in range(1 if sweep else 2)]}
        relayed = replies[1].error                   # the worker's error reaches the caller whole
        assert relayed.code == "MODEL_EXECUTION_ERROR" and relayed.message == "boom"
        assert relayed.details == {"exception": "ValueError", "model": "mlp"}
        if not sweep:
            assert replies[2].error.code == "DEADLINE_EXCEEDED"
        stats = await rig.stats()
        assert stats["errors"] == {"DEADLINE_EXCEEDED": 1, "MODEL_EXECUTION_ERROR": 1} and stats["queued"] == 0
        assert not rig.worker.poll(0), "the expired request reached the worker"

    run(model_files, scenario, max_inflight_batches_per_worker=1)


@pytest.mark.parametrize("sweep", [True, False], ids=["swept-by-tick", "dropped-at-dispatch"])
def test_request_its_batch_cannot_finish_in_time_is_never_computed(model_files, sweep):
    async def scenario(rig: Rig, clock: Clock):
        rig.broker.costs.observe("mlp", 0, 1, 500_000)   # the cost model: a batch of one takes 0.5 s
        rig.infer(1, timeout_ms=60_000)
        first = await rig.batch()
        rig.infer(2, timeout_ms=2_000)               # admitted: 2 s left > 0.5 s predicted
        assert (await rig.stats())["queued"] == 1
        clock.t += 1.7                               # 0.3 s left: not yet due, but no batch can make it
        if sweep:
            rig.broker.tick(clock())
        else:
            done = [BlockTensor(name="y", dtype="float32", shape=[1, 10], offset=rig.handle.input_bytes,
                                nbytes=40)]
            rig.worker.send(encode(Done(batch_id=first.batch_id, outputs=done, block=0, compute_us=500_000)))
            assert (await rig.reply()).id == 1
        err = await rig.reply()
        assert isinstance(err, ErrorReply) and err.id == 2 and err.error.code == "DEADLINE_EXCEEDED"
        assert not rig.worker.poll(0), "a request no batch could answer in time reached the worker"

    run(model_files, scenario, max_inflight_batches_per_worker=1)


def test_next_batch_is_staged_just_in_time_not_behind_a_long_one(model_files):
    async def scenario(rig: Rig, clock: Clock):
        rig.broker.costs.observe("mlp", 0, 1, 60_000_000)   # a batch takes a minute: staging waits for its end
        rig.infer(1, timeout_ms=600_000)
        first = await rig.batch()
        rig.infer(2, timeout_ms=600_000)
        assert (await rig.stats())["queued"] == 1        # room for a second batch, but not staged yet
        assert not rig.worker.poll(0)
        done = [BlockTensor(name="y", dtype="float32", shape=[1, 10], offset=rig.handle.input_bytes, nbytes=40)]
        rig.worker.send(encode(Done(batch_id=first.batch_id, outputs=done, block=0, compute_us=1000)))
        assert (await rig.reply()).id == 1
        assert (await rig.batch()).splits == [1]          # staged the moment the worker was free

    run(model_files, scenario)


def test_lost_worker_request_is_retried_once_then_worker_died(model_files):
    async def scenario(rig: Rig, clock: Clock):
        rig.infer(7, timeout_ms=60_000)
        for life in range(2):
            batch = await rig.batch()
            assert [len(t.shape) for t in batch.inputs] == [2] and batch.rows == 1
            rig.handle.exited()                      # the process died holding the batch
            rig.broker.serving.remove_worker(rig.handle)
            if life == 0:                            # retried on the worker's next life
                await rig.next_life()
        err = await rig.reply()
        assert err.id == 7 and err.error.code == "WORKER_DIED" and err.error.retryable

    run(model_files, scenario)


# ---- a batch answered in parts (its outputs did not fit the output arena as one block) ---------

async def three_in_one_batch(rig: Rig) -> Batch:
    """Requests 1, 2 and 3 of "mlp" staged as one batch: request 0 holds the worker meanwhile."""
    rig.infer(0, timeout_ms=60_000)
    first = await rig.batch()
    for i in (1, 2, 3):
        rig.infer(i, timeout_ms=60_000)
    await until(lambda: rig.broker.batcher.queued("mlp") == 3, "three queued requests")
    rig.worker.send(encode(Done(batch_id=first.batch_id, error=fail(Code.INTERNAL, "skip").to_body())))
    assert (await rig.reply()).id == 0
    batch = await rig.batch()
    assert batch.splits == [1, 1, 1] and batch.rows == 3
    return batch


def write_part(rig: Rig, y: np.ndarray, block: int) -> list:
    """Write outputs y ([rows, 10] float32) of "mlp" into the output arena at `block`."""
    offset = rig.handle.input_bytes + block
    rig.handle.segment.buf[offset:offset + y.nbytes] = y.tobytes()
    return [BlockTensor(name="y", dtype="float32", shape=list(y.shape), offset=offset, nbytes=y.nbytes)]


async def answer(rig: Rig) -> tuple:
    """The next reply: (its header, its first tensor or None)."""
    frames = await recv(rig.client)
    reply = reply_decoder.decode(frames[0])
    return reply, np.frombuffer(frames[1], np.float32).reshape(reply.outputs[0].shape) if len(frames) > 1 else None


def test_parts_answer_their_requests_and_release_their_blocks(model_files):
    async def scenario(rig: Rig, clock: Clock):
        batch = await three_in_one_batch(rig)
        y = np.arange(20, dtype=np.float32).reshape(2, 10)
        rig.worker.send(encode(Done(batch_id=batch.batch_id, outputs=write_part(rig, y, 0), block=0,
                                    first=0, count=2, final=False)))
        (r1, y1), (r2, y2) = await answer(rig), await answer(rig)
        assert (r1.id, r2.id) == (1, 2)
        np.testing.assert_array_equal(y1, y[:1])
        np.testing.assert_array_equal(y2, y[1:])
        release = to_worker_decoder.decode((await recv(rig.worker))[0])
        assert release.blocks == [0]                 # freed at once: the worker may wait for that space
        assert batch.batch_id in rig.handle.inflight and rig.handle.inputs.live_blocks == 1
        body = fail(Code.OUT_OF_SHM, "too big", arena="output").to_body()
        rig.worker.send(encode(Done(batch_id=batch.batch_id, error=body, first=2, count=1, final=True)))
        r3 = await rig.reply()
        assert r3.id == 3 and r3.error.code == "OUT_OF_SHM" and r3.error.details["arena"] == "output"
        stats = await rig.stats()                     # every request answered exactly once, nothing owed
        assert stats["replies"] == 2 and stats["errors"] == {"INTERNAL": 1, "OUT_OF_SHM": 1}
        assert stats["batches"] == 1 and not rig.handle.inflight and rig.handle.inputs.live_blocks == 0
        assert not rig.client.poll(0)

    run(model_files, scenario, max_inflight_batches_per_worker=1)


def test_worker_death_after_a_part_retries_only_the_rest(model_files):
    async def scenario(rig: Rig, clock: Clock):
        batch = await three_in_one_batch(rig)
        y = np.ones((1, 10), np.float32)
        rig.worker.send(encode(Done(batch_id=batch.batch_id, outputs=write_part(rig, y, 0), block=0,
                                    first=0, count=1, final=False)))
        assert (await answer(rig))[0].id == 1
        assert [p.req_id for p in rig.handle.inflight[batch.batch_id].requests] == [2, 3]
        rig.handle.exited()                          # dies holding requests 2 and 3
        rig.broker.serving.remove_worker(rig.handle)
        await rig.next_life()
        retried = []
        for _ in range(2):                           # each retried alone, request 1 not again
            b = await rig.batch()
            assert b.rows == 1
            rig.worker.send(encode(Done(batch_id=b.batch_id, outputs=write_part(rig, 2 * y, 0), block=0)))
            reply, out = await answer(rig)
            retried.append(reply.id)
            np.testing.assert_array_equal(out, 2 * y)
        assert sorted(retried) == [2, 3]
        stats = await rig.stats()
        assert stats["replies"] == 3 and not rig.handle.inflight and not rig.client.poll(0)

    run(model_files, scenario, max_inflight_batches_per_worker=1)


def test_admission_refuses_while_every_worker_is_benched(model_files):
    cfg = parse_config(base_config(model_files, "mlp"), base_dir="/", source="test")
    worker = WorkerHandle(0, "cpu", [], Segment.create(new_name("ring"), 128 << 10), 64 << 10, 64 << 10)
    try:
        with assembled(cfg) as broker:
            broker.registry.models["mlp"].records["1"].seen = True
            broker.serving.add_worker(worker)
            req = Infer(v=PROTOCOL_VERSION, id=1, model="mlp", inputs=[TensorMeta(name="x", dtype="float32",
                                                                                shape=list(X.shape))])
            worker.benched = "crash loop: worker0[cpu] died 5 times in 60 s"
            with pytest.raises(TgwError) as info:
                broker.admission.admit(b"c", req, [zmq.Frame(X.tobytes())])
            assert info.value.code == Code.MODEL_NOT_READY and info.value.details["reason"] == "crash_loop"
            assert "died 5 times" in info.value.message
            worker.benched = ""
            assert broker.admission.admit(b"c", req, [zmq.Frame(X.tobytes())]).req_id == 1
    finally:
        worker.segment.close()
        worker.segment.unlink()


def test_a_grpc_burst_is_batched_and_a_lone_grpc_request_is_not_held(model_files):
    """gRPC's requests (door.infer with the face's caller) that find others unanswered wait for
    the burst (Serving.arrived, FACE_HOLD_S) and go as one batch; a lone one goes at once."""
    from tgw.broker.faces.grpc.infer import GrpcCaller
    from tgw.broker.front.regions import SliceFrame

    async def scenario(rig: Rig, clock: Clock):
        loop = asyncio.get_running_loop()

        def face_infer(req_id: int) -> GrpcCaller:
            caller = GrpcCaller(loop)
            msg = Infer(v=PROTOCOL_VERSION, id=req_id, model="mlp", timeout_ms=600_000,
                        inputs=[TensorMeta(name="x", dtype="float32", shape=list(X.shape))])
            rig.broker.door.infer(caller, msg, [SliceFrame(memoryview(X.tobytes()))])
            return caller

        alone = face_infer(1)
        first = await rig.batch()                     # nobody else unanswered: sent at once, not held
        assert len(first.splits) == 1
        done = [BlockTensor(name="y", dtype="float32", shape=[1, 10], offset=rig.handle.input_bytes, nbytes=40)]
        rig.worker.send(encode(Done(batch_id=first.batch_id, outputs=done, block=0, compute_us=100)))
        reply, _ = await alone.future
        assert reply.id == 1
        callers = [face_infer(i) for i in (2, 3, 4)]   # a burst: the 2nd finds the 1st unanswered
        assert (await rig.stats())["queued"] == 3      # the window is open (the clock stands still)
        assert not rig.worker.poll(0), "a face's burst went out before its window closed"
        clock.t += 0.001                               # the window (0.5 ms) is over: one batch of all three
        batch = await rig.batch()
        assert len(batch.splits) == 3
        rig.worker.send(encode(Done(batch_id=batch.batch_id, outputs=[
            BlockTensor(name="y", dtype="float32", shape=[3, 10], offset=rig.handle.input_bytes, nbytes=120)],
            block=0, compute_us=100)))
        assert sorted([(await c.future)[0].id for c in callers]) == [2, 3, 4]

    run(model_files, scenario)
