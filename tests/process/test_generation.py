"""Generation end to end (issue 40): a real broker, one CPU worker running the step loop of
tgw.testing.generators' Counter (output n of a prompt is (sum(prompt) + n) % 1000, so every
stream is checkable), driven by raw ZeroMQ DEALERs speaking tgw.shm.wire.

Continuous admission (a late request's stream ends while an early long one still runs); each
means of cancellation (native cancel, bye, deadline, the caller's process killed) frees its slot
by the worker's own count; a caller that does not read is ended OVERLOADED; the slot pool
exhausted (requests wait, then are served; past max_queue OVERLOADED); a handler raising in
prefill and in step (answered with its message, the worker alive); and, last, a SIGKILLed
worker's stream resumed whole and exact.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest
import zmq

from conftest import served
from tgw.client import Client
from tgw.shm.wire import PROTOCOL_VERSION, Cancel, ErrorReply, GenerateEnd, GenerateOutputs, GenerateParams, \
    Goodbye, Infer, Sampling, TensorMeta, encode, reply_decoder
from tgw.testing.cancellation import wait_for
from tgw.testing.generators import counter_outputs, entry, toylm_reference

pytestmark = pytest.mark.process
WAIT_S = 60.0


@pytest.fixture(scope="module")
def broker():
    d = tempfile.mkdtemp(prefix="tgwg-", dir="/tmp")
    cfg = {"workers": {"devices": ["cpu"], "threads_per_worker": 1, "input_arena_mb": 4, "output_arena_mb": 2},
           "models": [
               {**entry("cnt", options={"step_ms": 5}, max_sequences=8, max_outputs=100_000), "max_queue": 16},
               {**entry("tight", options={"step_ms": 5}, max_sequences=2, max_outputs=30), "max_queue": 2},
               entry("lazy", max_sequences=2, max_outputs=1_000_000, max_unread_outputs=8),
               entry("bad", options={"raise_prefill_on": 666, "raise_at": 3}, max_sequences=4, max_outputs=10),
               entry("lm", "ToyLM", options={"step_ms": 5}, max_sequences=4, max_outputs=1000),
           ]}
    yield from served(cfg, d)


class Caller:
    """A raw DEALER: generations sent, and their messages read in order."""

    def __init__(self, address: str, rcvhwm: int = 1000):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.RCVHWM, rcvhwm)
        self.sock.connect(address)

    def generate(self, req_id: int, model: str, prompt: list[int], timeout_ms: int = 120_000, **params) -> None:
        x = np.asarray([prompt], np.int64)
        self.sock.send_multipart([encode(Infer(v=PROTOCOL_VERSION, id=req_id, model=model, timeout_ms=timeout_ms,
                                               inputs=[TensorMeta(name="prompt", dtype="int64", shape=list(x.shape))],
                                               generate=GenerateParams(**params))), x.tobytes()])

    def send(self, msg) -> None:
        self.sock.send(encode(msg))

    def read(self):
        assert self.sock.poll(WAIT_S * 1000), "no message from the broker"
        frames = self.sock.recv_multipart()
        return reply_decoder.decode(frames[0]), frames[1:]

    def stream(self, req_id: int, outputs: dict | None = None):
        """Read until `req_id`'s stream ends: (its outputs in order, its end); other ids' outputs
        go to `outputs` by id."""
        outputs = {} if outputs is None else outputs
        while True:
            if ("end", req_id) in outputs:   # read while another stream was awaited
                return outputs.get(req_id, []), outputs.pop(("end", req_id))
            msg, frames = self.read()
            if isinstance(msg, GenerateOutputs):
                got = outputs.setdefault(msg.id, [])
                assert msg.first == len(got), f"stream {msg.id}: output {msg.first} after {len(got)}"
                got += np.frombuffer(frames[0], np.int64).tolist()
            elif msg.id == req_id:
                return outputs.get(req_id, []), msg
            else:
                outputs.setdefault(("end", msg.id), msg)

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def generation(c: Client, model: str) -> dict:
    return c.status()["models"][model]["generation"]


def test_a_late_request_streams_while_an_early_long_one_runs(broker):
    a = Caller(broker.address)
    try:
        a.generate(1, "cnt", [1, 2], max_outputs=100_000)
        first, frames = a.read()
        assert isinstance(first, GenerateOutputs) and first.id == 1 and first.first == 0
        a.generate(2, "cnt", [5], max_outputs=5)
        outputs = {1: np.frombuffer(frames[0], np.int64).tolist()}
        got, end = a.stream(2, outputs)
        assert isinstance(end, GenerateEnd) and end.reason == "max_outputs" and got == counter_outputs([5], 5)
        assert ("end", 1) not in outputs, "the early stream ended first"
        assert end.first_output_ms > 0 and end.total_ms >= end.first_output_ms and end.seed is not None
        a.send(Cancel(v=PROTOCOL_VERSION, id=9, ids=[1]))
        with Client(broker.address) as c:
            wait_for(lambda: generation(c, "cnt")["active"] == 0, "the early stream ended on the worker", WAIT_S)
    finally:
        a.close()


KILLABLE = textwrap.dedent("""
    import sys, numpy as np, zmq
    from tgw.shm.wire import PROTOCOL_VERSION, GenerateParams, Infer, TensorMeta, encode
    s = zmq.Context().socket(zmq.DEALER)
    s.connect(sys.argv[1])
    s.send_multipart([encode(Infer(v=PROTOCOL_VERSION, id=1, model="cnt", timeout_ms=600_000,
                      inputs=[TensorMeta(name="prompt", dtype="int64", shape=[1, 1])],
                      generate=GenerateParams(max_outputs=100_000))), np.zeros((1, 1), np.int64).tobytes()])
    s.recv_multipart()
    print("streaming", flush=True)
    while True:
        s.recv_multipart()
""")


def test_each_means_of_cancellation_frees_its_slot(broker):
    """A native cancel, a bye, a deadline, the caller's process killed: each stream ends on the
    worker, counted by the worker itself (Steps.freed -> freed_by_cancel)."""
    with Client(broker.address) as c:
        base = generation(c, "cnt")["freed_by_cancel"]

        def freed(n: int) -> None:
            wait_for(lambda: generation(c, "cnt")["freed_by_cancel"] - base >= n and
                     generation(c, "cnt")["active"] == 0, f"{n} slot(s) freed by cancels", WAIT_S)

        a = Caller(broker.address)
        try:
            a.generate(1, "cnt", [3], max_outputs=100_000)
            assert isinstance(a.read()[0], GenerateOutputs)
            a.send(Cancel(v=PROTOCOL_VERSION, id=2, ids=[1]))
            msg = a.read()[0]
            while isinstance(msg, GenerateOutputs):   # outputs sent before the cancel was read
                msg = a.read()[0]
            assert type(msg).__name__ == "CancelReply" and msg.running == 1
            freed(1)
            assert not a.sock.poll(0), "a cancelled stream ends silently"

            a.generate(3, "cnt", [3], max_outputs=100_000)
            assert isinstance(a.read()[0], GenerateOutputs)
            a.send(Goodbye(v=PROTOCOL_VERSION))
            freed(2)

            b = Caller(broker.address)
            try:
                b.generate(4, "cnt", [3], timeout_ms=3_000, max_outputs=100_000)
                first, frames = b.read()
                assert isinstance(first, GenerateOutputs), f"no output before the deadline: {first}"
                got, end = b.stream(4, {4: np.frombuffer(frames[0], np.int64).tolist()})
                assert isinstance(end, ErrorReply) and end.error.code == "DEADLINE_EXCEEDED"
                assert got == counter_outputs([3], len(got))
                freed(3)
            finally:
                b.close()
        finally:
            a.close()

        child = subprocess.Popen([sys.executable, "-c", KILLABLE, broker.address], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "streaming"
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
            freed(4)
        finally:
            if child.poll() is None:
                child.kill()
        assert generation(c, "cnt")["ended"].get("cancelled", 0) >= 4


def test_a_caller_that_does_not_read_is_ended_overloaded(broker):
    lazy = Caller(broker.address, rcvhwm=1)
    try:
        lazy.generate(1, "lazy", [7])
        with Client(broker.address) as c:
            wait_for(lambda: c.stats()["models"]["lazy"]["errors"].get("OVERLOADED"), "the slow reader ended", WAIT_S)
            wait_for(lambda: generation(c, "lazy")["active"] == 0, "its slot freed", WAIT_S)
            assert generation(c, "lazy")["freed_by_cancel"] >= 1
        got, end = lazy.stream(1)
        assert isinstance(end, ErrorReply) and end.error.code == "OVERLOADED"
        assert "did not read its outputs" in end.error.message and got == counter_outputs([7], len(got))
    finally:
        lazy.close()


def test_the_slot_pool_exhausted_requests_wait_then_are_served(broker):
    a = Caller(broker.address)
    try:
        ends, outputs = {}, {}

        def take() -> None:
            msg, frames = a.read()
            if isinstance(msg, GenerateOutputs):
                outputs.setdefault(msg.id, []).extend(np.frombuffer(frames[0], np.int64).tolist())
            else:
                ends[msg.id] = msg

        a.generate(1, "tight", [1], max_outputs=30)
        a.generate(2, "tight", [2], max_outputs=30)
        while len(outputs) < 2:   # both slots taken
            take()
        for k in range(3, 6):     # a queue of 2: the fifth is refused
            a.generate(k, "tight", [k], max_outputs=30)
        while len(ends) < 5:
            take()
        refused = [k for k, e in ends.items() if isinstance(e, ErrorReply)]
        assert refused == [5] and ends[5].error.code == "OVERLOADED" and "queue" in ends[5].error.message
        for k in set(ends) - set(refused):
            assert isinstance(ends[k], GenerateEnd) and outputs[k] == counter_outputs([k], 30)
        with Client(broker.address) as c:
            assert generation(c, "tight")["slots"] == 2
    finally:
        a.close()


def test_a_handler_raising_in_prefill_or_step_answers_with_its_message(broker):
    with Client(broker.address) as c:
        pids = broker.worker_pids()
        a = Caller(broker.address)
        try:
            a.generate(1, "bad", [666])
            got, end = a.stream(1)
            assert got == [] and isinstance(end, ErrorReply) and "prefill refuses prompts starting with 666" in \
                end.error.message
            a.generate(2, "bad", [1])
            got, end = a.stream(2)
            assert got == counter_outputs([1], 3) and isinstance(end, ErrorReply)
            assert "step refuses output 3" in end.error.message
            a.generate(3, "bad", [2], max_outputs=2)   # the worker serves on
            got, end = a.stream(3)
            assert isinstance(end, GenerateEnd) and got == counter_outputs([2], 2)
        finally:
            a.close()
        assert broker.worker_pids() == pids and generation(c, "bad")["active"] == 0


def test_a_stream_survives_its_worker_being_killed(broker):
    """Last: it kills the module's worker, and stops the broker. Each stream continues on the
    restarted worker from the outputs sent, with none repeated or missing, equal to an
    uninterrupted run: a greedy one, and a sampled one (its draws depend on (seed, position) only)."""
    a = Caller(broker.address)
    try:
        n = 300
        sampled = Sampling(temperature=1.0, top_k=20, top_p=0.9, seed=1234)
        a.generate(1, "cnt", [4, 4], max_outputs=n)
        a.generate(2, "lm", [3, 9, 27], max_outputs=n, sampling=sampled)
        outputs: dict = {}
        while min(len(outputs.get(1, [])), len(outputs.get(2, []))) < 10:
            msg, frames = a.read()
            assert isinstance(msg, GenerateOutputs) and msg.first == len(outputs.get(msg.id, []))
            outputs.setdefault(msg.id, []).extend(np.frombuffer(frames[0], np.int64).tolist())
        (pid,) = broker.worker_pids()
        os.kill(pid, signal.SIGKILL)
        got, end = a.stream(1, outputs)
        assert isinstance(end, GenerateEnd), end
        assert got == counter_outputs([4, 4], n) and end.outputs == n and end.resumed == 1
        got, end = a.stream(2, outputs)
        assert isinstance(end, GenerateEnd) and end.resumed == 1 and end.seed == 1234, end
        assert got == toylm_reference([3, 9, 27], n, temperature=1.0, top_k=20, top_p=0.9, seed=1234)
        with Client(broker.address) as c:
            assert generation(c, "cnt")["resumed"] >= 1
    finally:
        a.close()
    # its restarted worker is this test's child: gone with the broker (the module's end checks again)
    assert broker.stop() == 0
