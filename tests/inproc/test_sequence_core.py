"""Sequence batching's hooks in the serving core, in-process: the real assembly over inproc://
sockets and a real ring, an injected clock; the test plays the caller and the worker.

Proves, without processes: the batch a worker gets names each request's slot and flags
(`Batch.steps`) with at most one request of a sequence per batch; a worker's death answers its
sequences' requests WORKER_DIED (retryable only for a start) and never runs them on its next
life; a later step of such a sequence says it was lost with its worker; the idle sweep at the
tick ends a sequence, and its slot is taken by the next start.
"""
from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest
import zmq

from test_broker_core import Clock, recv, until   # the core rig's clock and bounded waits

from tgw.broker.config.load import parse_config
from tgw.broker.core.assembly import assemble
from tgw.broker.state.pool import WorkerHandle, WorkerState
from tgw.shm.segment import Segment, new_name
from tgw.shm.wire import PROTOCOL_VERSION, Batch, BlockTensor, Done, ErrorReply, Infer, InferReply, LoadModels, \
    ModelLoaded, SequenceRef, TensorMeta, WorkerHello, WorkerReady, encode, reply_decoder, to_worker_decoder

pytestmark = pytest.mark.inproc
KEY = "acc:1"
_ports = itertools.count()
CONFIG = {"workers": {"devices": ["cpu"], "threads_per_worker": 1, "input_arena_mb": 1, "output_arena_mb": 1},
          "models": [{"name": "acc", "versions": [{"version": "1", "handler": "tgw.workers.none:Acc"}],
                      "inputs": [{"name": "x", "dtype": "float32", "shape": [1]}],
                      "outputs": [{"name": "y", "dtype": "float32", "shape": [1]}], "max_batch_size": 8,
                      "sequence_batching": {"max_sequences": 2, "max_sequence_idle_us": 1_000_000,
                                            "state": [{"name": "s", "dtype": "float32", "shape": [1]}]}}]}


class Rig:
    def __init__(self, cfg, clock: Clock):
        self.ctx = zmq.Context()
        n = next(_ports)
        front_addr, self.back_addr = f"inproc://qfront{n}", f"inproc://qback{n}"
        front, back = self.ctx.socket(zmq.ROUTER), self.ctx.socket(zmq.ROUTER)
        front.bind(front_addr)
        back.bind(self.back_addr)
        self.broker = assemble(cfg, asyncio.get_running_loop(), front, back, clock=clock)
        self.client = self.ctx.socket(zmq.DEALER)
        self.client.connect(front_addr)
        w = cfg.workers
        self.handle = WorkerHandle(0, "cpu", [], Segment.create(new_name("ring"), w.input_bytes + w.output_bytes),
                                   w.input_bytes, w.output_bytes)
        self.worker = None

    async def start_worker(self) -> None:
        if self.worker is not None:   # its next life
            self.worker.close(linger=0)
            old = self.handle.segment
            self.handle.renew(Segment.create(new_name("ring"), old.size))
            old.close()
            old.unlink()
        self.handle.spawned(None)
        self.broker.serving.add_worker(self.handle)
        self.worker = self.ctx.socket(zmq.DEALER)
        self.worker.setsockopt(zmq.IDENTITY, self.handle.identity)
        self.worker.connect(self.back_addr)
        self.worker.send(encode(WorkerHello(v=PROTOCOL_VERSION, worker_id=0, pid=4242)))
        load = to_worker_decoder.decode((await recv(self.worker))[0])
        assert isinstance(load, LoadModels) and load.models[0].sequence is not None
        self.worker.send(encode(ModelLoaded(worker_id=0, key=KEY, startup=True, slots=2)))
        self.worker.send(encode(WorkerReady(worker_id=0, models=[KEY])))
        await until(lambda: self.handle.state is WorkerState.READY, "the worker to be ready")

    def step(self, req_id: int, cid, start=False, end=False) -> None:
        header = Infer(v=PROTOCOL_VERSION, id=req_id, model="acc", timeout_ms=60_000,
                       inputs=[TensorMeta(name="x", dtype="float32", shape=[1, 1])],
                       sequence=SequenceRef(id=cid, start=start, end=end))
        self.client.send_multipart([encode(header), np.float32([[req_id]]).tobytes()])

    async def reply(self):
        return reply_decoder.decode((await recv(self.client))[0])

    async def replies(self, n: int) -> dict:
        out = {}
        for _ in range(n):
            r = await self.reply()
            out[r.id] = r
        return out

    async def batch(self) -> Batch:
        msg = to_worker_decoder.decode((await recv(self.worker))[0])
        assert isinstance(msg, Batch)
        return msg

    def done(self, batch: Batch) -> None:
        """The worker's answer: y = the slot of each row."""
        y = np.float32([[s.slot] for s in batch.steps])
        offset = self.handle.input_bytes
        self.handle.segment.buf[offset:offset + y.nbytes] = y.tobytes()
        self.worker.send(encode(Done(batch_id=batch.batch_id, block=0, outputs=[
            BlockTensor(name="y", dtype="float32", shape=[batch.rows, 1], offset=offset, nbytes=y.nbytes)])))

    def close(self) -> None:
        self.broker.close()
        self.ctx.destroy(linger=0)
        self.handle.segment.close()
        self.handle.segment.unlink()


def run(scenario):
    cfg = parse_config(CONFIG, base_dir="/", source="test")

    async def main():
        rig = Rig(cfg, Clock())
        try:
            await rig.start_worker()
            await scenario(rig, rig.broker.clock)
        finally:
            rig.close()

    asyncio.run(main())


def steps(batch: Batch) -> list[tuple]:
    return [(s.corrid, s.slot, s.start, s.end) for s in batch.steps]


def test_steps_name_their_slots_and_a_dead_workers_sequences_are_answered_not_moved():
    async def scenario(rig: Rig, clock):
        seqs = rig.broker.serving.sequences
        rig.step(1, 5, start=True)
        rig.step(2, 6, start=True)
        rig.step(3, 5)
        first = await rig.batch()
        second = await rig.batch()   # staged behind the first: 5's next step never shares its batch
        assert steps(first) == [(5, 0, True, False), (6, 1, True, False)] and steps(second) == [(5, 0, False, False)]
        rig.done(first)
        answered = await rig.replies(2)
        assert all(isinstance(r, InferReply) for r in answered.values())
        rig.step(4, 7, start=True)   # no free slot: it waits in the queue
        await until(lambda: rig.broker.batcher.queued("acc") == 1, "the third start queued")
        rig.handle.exited("killed by signal 9")
        rig.broker.serving.remove_worker(rig.handle)
        died = await rig.reply()
        assert isinstance(died, ErrorReply) and died.id == 3 and died.error.code == "WORKER_DIED"
        assert not died.error.retryable and "sequence 5" in died.error.message
        c = seqs.of("acc")
        assert c.ended == {"worker_died": 2} and c.live == 0 and c.slots == 0
        await rig.start_worker()
        third = await rig.batch()   # the waiting start runs on the next life; 5's step never does
        assert steps(third) == [(7, 0, True, False)]
        rig.done(third)
        assert isinstance(await rig.reply(), InferReply)
        rig.step(5, 5)
        err = await rig.reply()
        assert err.error.code == "INVALID_ARGUMENT" and "its worker died (worker0[cpu]: killed by signal 9)" \
            in err.error.message and not rig.worker.poll(0)

        # idle: 7 ends at the tick past its timeout; 8's start takes its slot
        clock.t += 1.5
        rig.broker.serving.tick(clock())
        assert c.ended["idle"] == 1 and c.live == 0
        rig.step(6, 8, start=True, end=True)
        last = await rig.batch()
        assert steps(last) == [(8, 0, True, True)] and c.misrouted == 0

    run(scenario)
