"""The broker's half of generation in-process (broker/generate/): the real assembly over inproc://
sockets and a real ring; the test plays the caller and the worker's step loop message by message.

Proves, without processes: admission's refusals; an admission batch no larger than the worker's
free slots and answered by the stream, not an InferReply; each Steps row to its caller at once,
then GenerateEnd after the last output; a cancel, a goodbye and a deadline sent to the worker as
CancelSequences and the slot free only at the worker's end; a queued generation waiting for a
slot; a dead worker's running sequence re-queued with its prefix, and WORKER_DIED at its second
death; a handler's error relayed.
"""
from __future__ import annotations

import asyncio
import itertools
import time

import numpy as np
import pytest
import zmq

from tgw.broker.config.load import parse_config
from tgw.broker.core.assembly import assemble
from tgw.broker.state.pool import WorkerHandle, WorkerState
from tgw.shm.errors import Code, fail
from tgw.shm.segment import Segment, new_name
from tgw.shm.wire import PROTOCOL_VERSION, Batch, CancelSequences, Cancel, CancelReply, Done, ErrorReply, \
    GenerateEnd, GenerateOutputs, GenerateParams, Goodbye, Infer, LoadModels, ModelLoaded, Sampling, SeqEnd, \
    StepRows, Steps, TensorMeta, WorkerHello, WorkerReady, encode, reply_decoder, to_worker_decoder

pytestmark = pytest.mark.inproc
WAIT_S = 10.0
KEY = "gen:1"
_ports = itertools.count()


def config(**gen) -> dict:
    g = {"state": [{"name": "kv", "dtype": "float32", "shape": [4]}], "max_sequences": 2, "max_outputs": 16}
    g.update(gen)
    return {"workers": {"devices": ["cpu"], "threads_per_worker": 1, "input_arena_mb": 1, "output_arena_mb": 1},
            "models": [{"name": "gen", "versions": [{"version": "1", "handler": "tgw.workers.none:Gen"}],
                        "inputs": [{"name": "prompt", "dtype": "int64", "shape": [-1]}],
                        "outputs": [{"name": "token", "dtype": "int64", "shape": []}],
                        "max_batch_size": 8, "max_queue": 2, "generator": g},
                       {"name": "echo", "versions": [{"version": "1", "handler": "tgw.workers.none:Echo"}],
                        "inputs": [{"name": "x", "dtype": "float32", "shape": [2]}],
                        "outputs": [{"name": "x", "dtype": "float32", "shape": [2]}]}]}


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.001)


async def recv(sock: zmq.Socket) -> list[bytes]:
    await until(lambda: sock.poll(0), "a message")
    return sock.recv_multipart()


class Rig:
    def __init__(self, cfg, clock: Clock):
        self.ctx = zmq.Context()
        n = next(_ports)
        front_addr, self.back_addr = f"inproc://gfront{n}", f"inproc://gback{n}"
        front, back = self.ctx.socket(zmq.ROUTER), self.ctx.socket(zmq.ROUTER)
        front.setsockopt(zmq.ROUTER_MANDATORY, 1)   # as the broker's own (front/endpoints.py): a full queue says so
        front.bind(front_addr)
        back.bind(self.back_addr)
        self.broker = assemble(cfg, asyncio.get_running_loop(), front, back, clock=clock)
        self.clients = {}
        for name in ("a", "b"):
            c = self.clients[name] = self.ctx.socket(zmq.DEALER)
            c.setsockopt(zmq.IDENTITY, name.encode())
            c.connect(front_addr)
        w = cfg.workers
        self.handle = WorkerHandle(0, "cpu", [], Segment.create(new_name("ring"), w.input_bytes + w.output_bytes),
                                   w.input_bytes, w.output_bytes)
        self.worker = None
        self.streams = self.broker.serving.streams

    async def start_worker(self, slots: int = 2) -> None:
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
        assert isinstance(load, LoadModels)
        spec = next(m for m in load.models if m.name == "gen")
        assert spec.generator is not None and spec.generator.max_sequences == 2
        self.worker.send(encode(ModelLoaded(worker_id=0, key=KEY, startup=True, slots=slots)))
        self.worker.send(encode(WorkerReady(worker_id=0, models=[KEY, "echo:1"])))
        await until(lambda: self.handle.state is WorkerState.READY, "the worker to be ready")

    def generate(self, req_id: int, prompt=(1, 2, 3), caller="a", timeout_ms=60_000, **params) -> None:
        x = np.asarray([prompt], np.int64)
        header = Infer(v=PROTOCOL_VERSION, id=req_id, model="gen", timeout_ms=timeout_ms,
                       inputs=[TensorMeta(name="prompt", dtype="int64", shape=list(x.shape))],
                       generate=GenerateParams(**params))
        self.clients[caller].send_multipart([encode(header), x.tobytes()])

    async def reply(self, caller="a"):
        frames = await recv(self.clients[caller])
        return reply_decoder.decode(frames[0]), frames[1:]

    async def to_worker(self):
        return to_worker_decoder.decode((await recv(self.worker))[0])

    async def admit(self, n: int) -> Batch:
        """The next admission batch, answered as the worker answers it: a Done without outputs."""
        batch = await self.to_worker()
        assert isinstance(batch, Batch) and len(batch.sequences) == n
        self.worker.send(encode(Done(batch_id=batch.batch_id)))
        return batch

    def steps(self, rows: list[tuple[int, int, int]], ended=(), freed=0) -> None:
        """rows: (seq, position, token)."""
        data = np.asarray([t for _, _, t in rows], np.int64).tobytes()
        self.worker.send(encode(Steps(worker_id=0, key=KEY, seqs=[s for s, _, _ in rows],
                                      positions=[p for _, p, _ in rows],
                                      outputs=[StepRows(name="token", dtype="int64", shape=[len(rows)], data=data)]
                                      if rows else [], ended=list(ended), slots=2, freed=freed)))

    def close(self) -> None:
        self.broker.close()
        self.ctx.destroy(linger=0)
        self.handle.segment.close()
        self.handle.segment.unlink()


def run(scenario, **gen):
    cfg = parse_config(config(**gen), base_dir="/", source="test")

    async def main():
        rig = Rig(cfg, Clock())
        try:
            await rig.start_worker()
            await scenario(rig, rig.broker.clock)
        finally:
            rig.close()

    asyncio.run(main())


def token(frames) -> list[int]:
    return np.frombuffer(frames[0], np.int64).tolist()


def test_refusals_at_admission():
    async def scenario(rig: Rig, clock):
        cases = [
            (dict(max_outputs=17), "max_outputs 17"), (dict(max_outputs=0), "max_outputs 0"),
            (dict(sampling=Sampling(temperature=-1.0)), "temperature"), (dict(sampling=Sampling(top_p=0.0)), "top_p"),
            (dict(sampling=Sampling(top_k=-2)), "top_k"),
        ]
        for k, (params, said) in enumerate(cases, 1):
            rig.generate(k, **params)
            err, _ = await rig.reply()
            assert isinstance(err, ErrorReply) and err.error.code == "INVALID_ARGUMENT" and said in err.error.message
        x = np.zeros((2, 3), np.int64)   # two rows
        rig.clients["a"].send_multipart([encode(Infer(v=PROTOCOL_VERSION, id=20, model="gen", inputs=[
            TensorMeta(name="prompt", dtype="int64", shape=[2, 3])], generate=GenerateParams())), x.tobytes()])
        err, _ = await rig.reply()
        assert err.error.code == "INVALID_ARGUMENT" and "one row" in err.error.message
        rig.clients["a"].send_multipart([encode(Infer(v=PROTOCOL_VERSION, id=21, model="gen", inputs=[
            TensorMeta(name="prompt", dtype="int64", shape=[1, 3])])), x[:1].tobytes()])
        err, _ = await rig.reply()
        assert err.error.code == "INVALID_ARGUMENT" and "'gen' is a generator" in err.error.message
        rig.clients["a"].send_multipart([encode(Infer(v=PROTOCOL_VERSION, id=22, model="echo", inputs=[
            TensorMeta(name="x", dtype="float32", shape=[1, 2])], generate=GenerateParams())), b"\0" * 8])
        err, _ = await rig.reply()
        assert err.error.code == "INVALID_ARGUMENT" and "'echo' is not a generator" in err.error.message
        assert not rig.worker.poll(0)

    run(scenario)


def test_outputs_stream_at_once_and_the_end_follows_the_last():
    async def scenario(rig: Rig, clock):
        rig.generate(1, max_outputs=3, sampling=Sampling(seed=7))
        batch = await rig.admit(1)
        gen = batch.sequences[0]
        assert (gen.max_outputs, gen.sampling.seed, gen.delivered) == (3, 7, 0)
        assert not rig.clients["a"].poll(0), "an admission batch's Done is not the answer"
        for pos in range(3):
            clock.t += 0.01
            rig.steps([(gen.seq, pos, 10 + pos)], ended=[SeqEnd(seq=gen.seq, reason="max_outputs")] if pos == 2 else [])
            out, frames = await rig.reply()
            assert isinstance(out, GenerateOutputs) and (out.id, out.first, out.count) == (1, pos, 1)
            assert token(frames) == [10 + pos] and out.outputs[0].shape == [1]
        end, _ = await rig.reply()
        assert isinstance(end, GenerateEnd)
        assert (end.reason, end.outputs, end.seed, end.resumed) == ("max_outputs", 3, 7, 0)
        assert end.first_output_ms == pytest.approx(10.0) and end.total_ms == pytest.approx(30.0)
        c = rig.streams.counters["gen"].as_dict()
        assert (c["active"], c["started"], c["outputs"], c["ended"], c["slots"]) == (0, 1, 3, {"max_outputs": 1}, 2)
        assert rig.broker.view.generators["gen"] is rig.streams.counters["gen"]   # what status and /metrics read
        rig.generate(2)   # no seed: one is drawn, and reported
        gen = (await rig.admit(1)).sequences[0]
        assert gen.sampling.seed is not None and gen.max_outputs == 16
        rig.steps([(gen.seq, 0, 5)], ended=[SeqEnd(seq=gen.seq, reason="done")])
        await rig.reply()
        end, _ = await rig.reply()
        assert end.seed == gen.sampling.seed

    run(scenario)


def test_slots_bound_the_admission_batches_and_a_freed_slot_takes_the_next():
    async def scenario(rig: Rig, clock):
        for k in range(1, 3):
            rig.generate(k)
        batch = await rig.admit(2)   # two slots, both taken: what comes next waits in the queue
        seqs = [g.seq for g in batch.sequences]
        for k in range(3, 6):
            rig.generate(k)          # max_queue 2: the queue holds 3 and 4
        err, _ = await rig.reply()
        assert err.id == 5 and err.error.code == "OVERLOADED"
        assert not rig.worker.poll(0)
        rig.steps([(seqs[0], 0, 1), (seqs[1], 0, 2)], ended=[SeqEnd(seq=seqs[0], reason="done")])
        replies = [(await rig.reply())[0] for _ in range(3)]
        assert [type(r).__name__ for r in replies] == ["GenerateOutputs", "GenerateOutputs", "GenerateEnd"]
        batch = await rig.admit(1)   # one slot freed: one more
        assert batch.ids == [3]

    run(scenario)


def test_cancel_goodbye_and_deadline_reach_the_worker_and_free_the_slot_at_its_end():
    async def scenario(rig: Rig, clock):
        rig.generate(1, caller="a")
        rig.generate(2, caller="b", timeout_ms=500)
        batch = await rig.admit(2)
        seqs = [g.seq for g in batch.sequences]
        assert batch.ids == [1, 2]
        rig.steps([(seqs[0], 0, 1), (seqs[1], 0, 1)])
        await rig.reply("a")
        await rig.reply("b")
        rig.clients["a"].send(encode(Cancel(v=PROTOCOL_VERSION, id=9, ids=[1])))
        reply, _ = await rig.reply("a")
        assert isinstance(reply, CancelReply) and (reply.cancelled, reply.running) == (0, 1)
        ask = await rig.to_worker()
        assert isinstance(ask, CancelSequences) and ask.seqs == [seqs[0]]
        clock.t += 1.0
        rig.broker.tick(clock())     # past b's deadline
        err, _ = await rig.reply("b")
        assert err.error.code == "DEADLINE_EXCEEDED"
        ask = await rig.to_worker()
        assert ask.seqs == [seqs[1]] and ask.reason == "deadline"
        rig.generate(3, caller="a")
        assert not rig.worker.poll(0), "slots are taken until the worker says the sequences ended"
        rig.steps([(seqs[0], 1, 1)], ended=[SeqEnd(seq=seqs[0], reason="cancelled"),
                                             SeqEnd(seq=seqs[1], reason="cancelled")], freed=2)
        seq3 = (await rig.admit(1)).sequences[0].seq
        assert not rig.clients["a"].poll(0) and not rig.clients["b"].poll(0), "a cancelled stream gets nothing"
        rig.steps([(seq3, 0, 4)])
        await rig.reply("a")
        rig.clients["a"].send(encode(Goodbye(v=PROTOCOL_VERSION)))
        ask = await rig.to_worker()
        assert isinstance(ask, CancelSequences) and ask.seqs == [seq3]
        c = rig.streams.counters["gen"]
        assert c.freed_by_cancel == 2 and c.ended["cancelled"] == 2
        assert rig.broker.door.cancelled() == {"gen": {"generating": 2}}   # the cancel and the bye
        stats = rig.broker.callers.owed.by_caller
        assert stats == {}, "every generation left the callers' accounts"

    run(scenario)


def test_a_dead_workers_sequence_resumes_with_its_prefix_then_fails_at_the_second_death():
    async def scenario(rig: Rig, clock):
        rig.generate(1, max_outputs=8)
        seq = (await rig.admit(1)).sequences[0].seq
        rig.steps([(seq, 0, 11)])
        rig.steps([(seq, 1, 12)])
        for _ in range(2):
            await rig.reply()
        rig.handle.exited("killed")
        rig.broker.serving.remove_worker(rig.handle)
        await rig.start_worker()
        batch = await rig.admit(1)
        gen = batch.sequences[0]
        assert gen.seq == seq and gen.delivered == 2 and np.frombuffer(gen.prefix[0], np.int64).tolist() == [11, 12]
        rig.steps([(seq, 1, 99)])    # a repeat is never sent twice
        rig.steps([(seq, 2, 13)])
        out, frames = await rig.reply()
        assert out.first == 2 and token(frames) == [13]
        rig.handle.exited("killed again")
        rig.broker.serving.remove_worker(rig.handle)
        err, _ = await rig.reply()
        assert err.error.code == "WORKER_DIED" and "killed its worker twice" in err.error.message
        assert rig.streams.counters["gen"].resumed == 1 and rig.streams.table == {}

    run(scenario)


def test_an_admission_batch_lost_with_its_worker_is_retried_as_a_new_batch_and_forgotten():
    async def scenario(rig: Rig, clock):
        rig.generate(1, max_outputs=4)
        lost = await rig.to_worker()   # the worker dies before its Done
        assert isinstance(lost, Batch) and list(rig.streams.by_batch) == [lost.batch_id]
        rig.handle.exited("killed")
        rig.broker.serving.remove_worker(rig.handle)
        assert rig.streams.by_batch == {}
        await rig.start_worker()
        again = await rig.admit(1)
        assert again.batch_id != lost.batch_id and again.sequences[0].seq == lost.sequences[0].seq
        assert again.sequences[0].delivered == 0

    run(scenario)


def test_a_handlers_error_ends_its_stream_with_its_message():
    async def scenario(rig: Rig, clock):
        rig.generate(1)
        seq = (await rig.admit(1)).sequences[0].seq
        body = fail(Code.MODEL_EXECUTION_ERROR, "step exploded", exception="ValueError").to_body()
        rig.steps([], ended=[SeqEnd(seq=seq, reason="error", error=body)])
        err, _ = await rig.reply()
        assert err.error.code == "MODEL_EXECUTION_ERROR" and err.error.message == "step exploded"
        assert rig.streams.counters["gen"].ended == {"error": 1} and not rig.streams.table

    run(scenario)


def test_a_caller_that_does_not_read_is_ended_overloaded_and_its_slot_freed():
    async def scenario(rig: Rig, clock):
        rig.generate(1, caller="b")
        rig.generate(2, caller="a")
        seqs = [g.seq for g in (await rig.admit(2)).sequences]
        for pos in range(5):   # b reads nothing; a reads each output as it comes
            rig.steps([(seqs[0], pos, pos), (seqs[1], pos, pos)])
            out, _ = await rig.reply("a")
            assert out.first == pos
        ask = await rig.to_worker()   # the fifth unread output is one too many
        assert isinstance(ask, CancelSequences) and ask.seqs == [seqs[0]] and ask.reason == "slow_reader"
        got = [(await rig.reply("b"))[0] for _ in range(6)]
        assert [type(r).__name__ for r in got] == ["GenerateOutputs"] * 5 + ["ErrorReply"]
        assert got[-1].error.code == "OVERLOADED" and "did not read its outputs" in got[-1].error.message
        rig.steps([(seqs[1], 5, 5)], ended=[SeqEnd(seq=seqs[0], reason="cancelled")], freed=1)
        assert (await rig.reply("a"))[0].first == 5
        assert not rig.clients["b"].poll(0)

    run(scenario, max_unread_outputs=4)


def test_a_caller_whose_queue_is_full_still_gets_its_streams_end_once_it_reads():
    """Its queue (server.client_queue_messages, 1,000 by default, before max_unread_outputs'
    5,000 here) full: an output is dropped, the stream is ended OVERLOADED, and that error -
    refused by the same full queue - is sent again at the sweep until it goes out: the stream
    ends, it never hangs."""
    async def scenario(rig: Rig, clock):
        rig.generate(1, caller="b", max_outputs=6000)
        seq = (await rig.admit(1)).sequences[0].seq
        stream = rig.streams.table[seq]
        for pos in range(2100):   # inproc: the pipe holds both ends' high-water marks, 2 x 1,000
            rig.steps([(seq, pos, pos)])
            if pos % 500 == 499:   # the worker's own queue must not fill: the broker reads on this loop
                await until(lambda: stream.sent > pos or stream.closed, "the broker to take the steps")
        ask = await rig.to_worker()
        assert isinstance(ask, CancelSequences) and ask.seqs == [seq] and ask.reason == "slow_reader"
        assert len(rig.streams.owed) == 1
        got = []
        while rig.clients["b"].poll(0):
            got.append(reply_decoder.decode(rig.clients["b"].recv_multipart()[0]))
        assert {type(r).__name__ for r in got} == {"GenerateOutputs"} and len(got) >= 2000
        rig.streams.sweep(clock())
        assert not rig.streams.owed
        err, _ = await rig.reply("b")
        assert type(err) is ErrorReply and err.id == 1 and err.error.code == "OVERLOADED"
        assert "queue is full" in err.error.message

    run(scenario, max_unread_outputs=5000, max_outputs=6000)


def test_a_cancel_before_the_worker_took_the_batch_in_withdraws_it_or_ends_it_there():
    async def scenario(rig: Rig, clock):
        rig.generate(1)
        rig.generate(2)
        batch = await rig.to_worker()
        seqs = [g.seq for g in batch.sequences]
        rig.clients["a"].send(encode(Cancel(v=PROTOCOL_VERSION, id=9, ids=[1, 2])))
        reply, _ = await rig.reply()
        assert isinstance(reply, CancelReply) and reply.running == 2
        withdraw = await rig.to_worker()
        assert type(withdraw).__name__ == "Withdraw" and withdraw.requests == [0, 1]
        # the worker left the first out, but had taken the second in already
        rig.worker.send(encode(Done(batch_id=batch.batch_id, withdrawn=[0])))
        ask = await rig.to_worker()
        assert isinstance(ask, CancelSequences) and ask.seqs == [seqs[1]]
        assert rig.handle.sequences == {KEY: 1}   # the second's slot: taken until the worker's end
        rig.steps([], ended=[SeqEnd(seq=seqs[1], reason="cancelled")], freed=1)
        await until(lambda: not rig.handle.sequences, "the slot freed")
        assert not rig.clients["a"].poll(0) and rig.streams.table == {}

    run(scenario)
