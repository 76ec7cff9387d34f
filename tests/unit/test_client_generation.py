"""The native client's generate, without a broker: the request built from its arguments, a
sequence's outputs put in order (client/generation.py), and the sync and async streams against a
real peer - a ROUTER socket in a thread of this process that answers hello and models and lets
the test send `gen`, `gen_end` and `error` messages (client/gen_stream.py)."""
from __future__ import annotations

import asyncio
import gc
import os
import queue
import shutil
import tempfile
import threading

import numpy as np
import pytest
import zmq

from tgw.client import AsyncClient, Client, DeadlineExceededError, ModelExecutionError, OverloadedError, TgwError
from tgw.client.generation import GenerationEnd, Sequence, generate_params, one_row
from tgw.shm.errors import Code
from tgw.shm.wire import (PROTOCOL_VERSION, Cancel, CancelReply, ErrorBody, ErrorReply, GenerateEnd, GenerateOutputs,
                          Hello, HelloReply, Infer, IOSpec, ListModels, ModelInfo, ModelsReply, Sampling, TensorMeta,
                          encode, request_decoder)

from conftest import wait_until

TOKEN_MODEL = ModelInfo(name="gpt", versions=["1"], default_version="1", max_batch_size=8,
                        inputs=[IOSpec(name="prompt", dtype="int64", shape=[-1])],
                        outputs=[IOSpec(name="token", dtype="int64", shape=[])], ready=True)


# ---- the request -------------------------------------------------------------------------------


def test_params_from_none_a_dict_or_a_sampling():
    assert generate_params(None, None, None).sampling == Sampling()
    p = generate_params(5, {"temperature": 0.7, "top_k": 4, "stop_tokens": [0]}, 11)
    assert (p.max_outputs, p.sampling.temperature, p.sampling.top_k, p.sampling.seed, p.sampling.stop_tokens) == \
        (5, 0.7, 4, 11, [0])
    given = Sampling(top_p=0.5)
    p = generate_params(None, given, 3)
    assert (p.sampling.top_p, p.sampling.seed, given.seed) == (0.5, 3, None)   # the caller's Sampling untouched


@pytest.mark.parametrize("args, words", [
    ((0, None, None), "max_outputs must be a positive int"),
    ((True, None, None), "max_outputs must be a positive int"),
    ((None, {"temp": 1.0}, None), "no field 'temp'"),
    ((None, {"top_k": "x"}, None), "sampling: Expected `int`"),
    ((None, {"temperature": -1}, None), "temperature must be >= 0"),
    ((None, {"top_p": 0}, None), "top_p must be in (0, 1]"),
    ((None, {"stop_sequences": [[]]}, None), "each must hold at least one output"),
    ((None, [0.5], None), "sampling must be None, a dict"),
    ((None, {"seed": 1}, 2), "seed=2 and sampling's seed 1 differ"),
    ((None, None, 1.5), "seed must be an int"),
])
def test_bad_arguments_are_invalid_argument(args, words):
    with pytest.raises(TgwError) as e:
        generate_params(*args)
    assert e.value.code is Code.INVALID_ARGUMENT and words in str(e.value)


def test_one_row_adds_the_batch_dim_by_the_declared_rank():
    ranks = {"prompt": 1}
    assert one_row({"prompt": np.arange(3)}, ranks)["prompt"].shape == (1, 3)
    assert one_row({"prompt": [5]}, ranks)["prompt"] == [[5]]                # a prompt of one token
    assert one_row({"prompt": np.zeros((1, 4))}, ranks)["prompt"].shape == (1, 4)   # given with the dim
    assert one_row([1, 2], ranks)["prompt"] == [[1, 2]]                      # one input: given alone
    assert one_row({"text": "hi"}, {"text": 0})["text"] == ["hi"]            # a bytes scalar
    assert one_row({"prompt": [1, 2]}, None) == {"prompt": [1, 2]}           # model unknown: as given
    with pytest.raises(TgwError) as e:
        one_row({"prompt": np.zeros((2, 4))}, ranks)
    assert e.value.code is Code.INVALID_INPUT_SHAPE and "one sequence" in str(e.value) and "leading with 2" in \
        str(e.value)
    with pytest.raises(TgwError, match="this model takes a, b"):
        one_row([1], {"a": 1, "b": 1})


# ---- a sequence's outputs in order --------------------------------------------------------------


def gen(rid: int, first: int, values: list, dtype: str = "int64", name: str = "token", shape=()):
    arr = np.asarray(values, dtype=dtype).reshape(len(values), *shape)
    return (GenerateOutputs(v=PROTOCOL_VERSION, id=rid, first=first, count=len(values),
                            outputs=[TensorMeta(name=name, dtype=dtype, shape=list(arr.shape))]), [arr.tobytes()])


def end(rid: int, outputs: int, reason: str = "max_outputs") -> GenerateEnd:
    return GenerateEnd(v=PROTOCOL_VERSION, id=rid, model="gpt", version="1", reason=reason, outputs=outputs,
                       seed=7, first_output_ms=1.5, total_ms=9.0, resumed=1)


def error(rid: int, code: str = "OVERLOADED", message: str = "the caller read too slowly") -> ErrorReply:
    return ErrorReply(v=PROTOCOL_VERSION, id=rid, error=ErrorBody(code=code, message=message))


def drain(seq: Sequence) -> list:
    out = []
    while True:
        ready, item = seq.take()
        if not ready:
            return out
        out.append(item)


def test_sequence_orders_by_first_and_splits_coalesced_messages():
    seq = Sequence(1)
    seq.feed(*gen(1, 3, [13, 14]))          # ahead of a gap: held
    assert drain(seq) == []
    seq.feed(*gen(1, 0, [10, 11, 12]))      # fills it: both, in position order
    seq.feed(*gen(1, 4, [14, 15]))          # repeats position 4: only 15 is new
    seq.feed(*gen(1, 0, [10]))              # all repeated: dropped
    tokens = drain(seq)
    assert tokens == [10, 11, 12, 13, 14, 15] and all(type(t) is int for t in tokens)
    seq.feed(end(1, 6), [])
    with pytest.raises(StopIteration):
        seq.take()
    assert seq.final == GenerationEnd("max_outputs", 6, 7, 1.5, 9.0, 1, "gpt", "1")


def test_sequence_of_a_non_token_generator_gives_dicts():
    seq = Sequence(2)
    seq.feed(*gen(2, 0, [[0.5, 1.5], [2.5, 3.5]], dtype="float32", name="frame", shape=(2,)))
    items = drain(seq)
    assert [list(i) for i in items] == [["frame"], ["frame"]]
    np.testing.assert_array_equal(items[1]["frame"], np.array([2.5, 3.5], np.float32))


def test_an_error_comes_after_the_outputs_before_it():
    seq = Sequence(3)
    seq.feed(*gen(3, 0, [1, 2]))
    seq.feed(error(3, "MODEL_EXECUTION_ERROR", "step raised: boom"), [])
    seq.feed(*gen(3, 2, [3]))               # after the end: ignored
    assert seq.take() == (True, 1) and seq.take() == (True, 2)
    with pytest.raises(ModelExecutionError, match="boom"):
        seq.take()


def test_an_end_past_the_outputs_received_is_an_error():
    seq = Sequence(4)
    seq.feed(*gen(4, 0, [1]))
    seq.feed(*gen(4, 2, [3]))               # position 1 never came
    seq.feed(end(4, 3), [])
    assert seq.take() == (True, 1)
    with pytest.raises(TgwError, match="ended after 3 outputs but only 1 arrived"):
        seq.take()


# ---- the streams against a real peer ------------------------------------------------------------


class Peer:
    """A ROUTER bound at an ipc:// address, served by a thread: it answers hello and models
    itself; every other request lands in `requests` as (identity, message); `send(identity, msg,
    frames)` queues a message for the thread to send."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="tgwg-", dir="/tmp")
        self.address = f"ipc://{self.dir}/b.sock"
        self.requests: queue.Queue = queue.Queue()
        self._out: queue.Queue = queue.Queue()
        self._ctx = zmq.Context()
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        assert self._bound.wait(30)

    def _serve(self):
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.address)
        self._bound.set()
        while not self._stop.is_set():
            while not self._out.empty():
                sock.send_multipart(self._out.get())
            if not sock.poll(5):
                continue
            ident, header, *frames = sock.recv_multipart()
            msg = request_decoder.decode(header)
            if isinstance(msg, Hello):
                sock.send_multipart([ident, encode(HelloReply(v=PROTOCOL_VERSION, id=msg.id, server="peer",
                                                              max_request_bytes=1 << 30, max_inflight_per_client=4))])
            elif isinstance(msg, ListModels):
                sock.send_multipart([ident, encode(ModelsReply(v=PROTOCOL_VERSION, id=msg.id,
                                                               models=[TOKEN_MODEL]))])
            else:
                self.requests.put((ident, msg, frames))
        sock.close()

    def send(self, ident: bytes, msg, frames=()):
        self._out.put([ident, encode(msg), *frames])

    def next_request(self, kind):
        """The next request of type `kind` (others skipped: a cancel's answer comes from send)."""
        while True:
            ident, msg, frames = self.requests.get(timeout=30)
            if isinstance(msg, kind):
                return ident, msg, frames

    def close(self):
        self._stop.set()
        self._thread.join(30)
        self._ctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def peer():
    p = Peer()
    yield p
    p.close()


def answer(peer: Peer, ident: bytes, rid: int, tokens: list, first: int = 0, ending: bool = True):
    peer.send(ident, *gen(rid, first, tokens))
    if ending:
        peer.send(ident, end(rid, first + len(tokens)))


def test_sync_generate_sends_one_sequence_and_streams_its_outputs(peer):
    with Client(peer.address) as c:
        stream = c.generate("gpt", {"prompt": np.array([5, 6, 7])}, max_outputs=4, sampling={"top_k": 2}, seed=9,
                            timeout=30)
        ident, msg, frames = peer.next_request(Infer)
        assert msg.id == stream.id and msg.generate.max_outputs == 4
        assert (msg.generate.sampling.top_k, msg.generate.sampling.seed) == (2, 9)
        assert msg.inputs[0].shape == [1, 3] and np.frombuffer(frames[0], np.int64).tolist() == [5, 6, 7]
        answer(peer, ident, msg.id, [1, 2, 3], ending=False)
        answer(peer, ident, msg.id, [4], first=3)
        assert list(stream) == [1, 2, 3, 4]
        assert stream.final.reason == "max_outputs" and stream.final.outputs == 4 and stream.final.seed == 7


def test_sync_error_mid_stream_is_raised_after_the_outputs(peer):
    with Client(peer.address) as c:
        stream = c.generate("gpt", [1, 2])
        ident, msg, _ = peer.next_request(Infer)
        answer(peer, ident, msg.id, [8, 9], ending=False)
        peer.send(ident, error(msg.id))
        got = []
        with pytest.raises(OverloadedError, match="too slowly"):
            for token in stream:
                got.append(token)
        assert got == [8, 9] and stream.final is None


def test_sync_close_cancels_and_late_messages_are_dropped(peer):
    with Client(peer.address) as c:
        with c.generate("gpt", [1, 2]) as stream:
            ident, msg, _ = peer.next_request(Infer)
            answer(peer, ident, msg.id, [8], ending=False)
            assert next(stream) == 8
        _, cancel, _ = peer.next_request(Cancel)
        assert cancel.ids == [msg.id]
        assert list(stream) == []                        # closed: nothing more
        # its socket is closed (what was still on its way cannot crowd the next stream's connection)
        second = c.generate("gpt", [3])
        ident2, msg2, _ = peer.next_request(Infer)
        assert ident2 != ident
        answer(peer, ident2, msg2.id, [4, 5])
        assert list(second) == [4, 5] and second.final.outputs == 2
        # ended by the broker: its socket serves the next stream, which drops a late message for it
        peer.send(ident2, *gen(msg2.id, 2, [6]))
        third = c.generate("gpt", [7])
        ident3, msg3, _ = peer.next_request(Infer)
        assert ident3 == ident2
        answer(peer, ident3, msg3.id, [9])
        assert list(third) == [9]


def test_sync_stream_dropped_unfinished_is_cancelled(peer):
    with Client(peer.address) as c:
        stream = c.generate("gpt", [1])
        _, msg, _ = peer.next_request(Infer)
        del stream
        gc.collect()
        _, cancel, _ = peer.next_request(Cancel)
        assert cancel.ids == [msg.id]


def test_sync_streams_run_from_many_threads(peer):
    with Client(peer.address) as c:
        results, streams = {}, [c.generate("gpt", [i]) for i in range(3)]
        for _ in streams:
            ident, msg, frames = peer.next_request(Infer)
            p = int(np.frombuffer(frames[0], np.int64)[0])
            answer(peer, ident, msg.id, [p * 10, p * 10 + 1])

        def read(i):
            results[i] = list(streams[i])
        threads = [threading.Thread(target=read, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results == {0: [0, 1], 1: [10, 11], 2: [20, 21]}


def test_async_generate_streams_and_aclose_cancels(peer):
    async def run():
        async with AsyncClient(peer.address) as c:
            loop = asyncio.get_running_loop()
            stream = c.generate("gpt", {"prompt": [4, 5]}, max_outputs=3)
            first = asyncio.ensure_future(stream.__anext__())
            ident, msg, frames = await loop.run_in_executor(None, peer.next_request, Infer)
            assert msg.inputs[0].shape == [1, 2] and msg.generate.max_outputs == 3
            answer(peer, ident, msg.id, [1, 2], ending=False)
            answer(peer, ident, msg.id, [3], first=2)
            got = [await first] + [t async for t in stream]
            assert got == [1, 2, 3] and stream.final.total_ms == 9.0
            assert c.inflight == 0 and c._link.cap.held == 0 and not c._link.streams

            other = c.generate("gpt", [1])
            async with other:
                ident, msg, _ = await loop.run_in_executor(None, peer.next_request, Infer)
                answer(peer, ident, msg.id, [7], ending=False)
                assert await other.__anext__() == 7
            _, cancel, _ = await loop.run_in_executor(None, peer.next_request, Cancel)
            assert cancel.ids == [msg.id] and not c._link.streams
            assert [t async for t in other] == []

            third = c.generate("gpt", [2])     # the task awaiting it cancelled: so is the generation
            task = asyncio.ensure_future(third.__anext__())
            _, msg, _ = await loop.run_in_executor(None, peer.next_request, Infer)
            task.cancel()
            _, cancel, _ = await loop.run_in_executor(None, peer.next_request, Cancel)
            assert cancel.ids == [msg.id]
    asyncio.run(run())


def test_async_error_mid_stream_and_lost_connection(peer):
    async def run():
        async with AsyncClient(peer.address) as c:
            loop = asyncio.get_running_loop()
            stream = c.generate("gpt", [1])
            task = asyncio.ensure_future(stream.__anext__())
            ident, msg, _ = await loop.run_in_executor(None, peer.next_request, Infer)
            answer(peer, ident, msg.id, [5], ending=False)
            peer.send(ident, error(msg.id, "MODEL_EXECUTION_ERROR", "step raised: boom"))
            assert await task == 5
            with pytest.raises(ModelExecutionError, match="boom"):
                await stream.__anext__()
            assert c._link.cap.held == 0 and not c._link.streams
    asyncio.run(run())


def test_past_its_timeout_a_silent_stream_fails_and_is_cancelled(peer):
    with Client(peer.address) as c:
        stream = c.generate("gpt", [1], timeout=0.05)
        _, msg, _ = peer.next_request(Infer)
        with pytest.raises(DeadlineExceededError, match="no output from the broker"):
            next(stream)
        _, cancel, _ = peer.next_request(Cancel)
        assert cancel.ids == [msg.id]

    async def run():
        async with AsyncClient(peer.address) as ac:
            loop = asyncio.get_running_loop()
            s = ac.generate("gpt", [1], timeout=0.05)
            with pytest.raises(DeadlineExceededError, match="no output from the broker"):
                await s.__anext__()
            _, msg, _ = await loop.run_in_executor(None, peer.next_request, Infer)
            _, cancel, _ = await loop.run_in_executor(None, peer.next_request, Cancel)
            assert cancel.ids == [msg.id] and ac._link.cap.held == 0 and not ac._link.streams
    asyncio.run(run())
