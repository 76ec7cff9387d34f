"""A generator's step loop on its worker (workers/generate/) in-process, with the real toy
generators of tgw.testing.generators loaded as a worker loads them (make_runner, warm-up): the
loop driven directly iteration by iteration, then once through Server.serve() over a ROUTER as
the broker drives it. Continuous admission, cancels freeing slots, the pool exhausted, every end
reason, a handler that raises or fails a row or returns the wrong thing, resumption, and the
load's own checks (slot arithmetic, warm-up)."""
from __future__ import annotations

import itertools
import os
import threading
import time

import numpy as np
import pytest
import torch
import zmq

import stages
from test_worker_loader import LoaderSide

from tgw.shm.bytes_tensor import pack
from tgw.shm.errors import Code
from tgw.shm.ring import aligned_total
from tgw.shm.segment import Segment, new_name
from tgw.shm.views import block_view
from tgw.shm.wire import (PROTOCOL_VERSION, Batch, BlockTensor, CancelSequences, Done, GeneratorSpec, GenSeq, IOSpec,
                          LoadModel, ModelLoaded, ModelSpec, Sampling, Steps, Stop, StateSpec, WorkerHello, encode,
                          from_worker_decoder)
from tgw.testing import generators
from tgw.testing.generators import counter_outputs, toylm_reference
from tgw.workers.generate.intake import Refused, sequence
from tgw.workers.generate.loop import StepLoop
from tgw.workers.generate.runner import GeneratorLoadError, GeneratorProofError
from tgw.workers.serve import Server
from tgw.workers.stage_runner import StageRunner, make_runner

CPU = torch.device("cpu")
GENERATORS_FILE = os.path.abspath(generators.__file__)
WAIT_S = 10.0


def spec(cls: str = "Counter", options: dict | None = None, state_memory: int = 0, prompt: str = "int64",
         **gen) -> ModelSpec:
    out, state = {"Counter": ("value", StateSpec(name="acc", dtype="int64", shape=[3])),
                  "ToyLM": ("token", StateSpec(name="n", dtype="int64", shape=[2]))}[cls]
    g = GeneratorSpec(state=[state], max_sequences=0 if state_memory else gen.pop("max_sequences", 4),
                      state_memory=state_memory, **gen)
    return ModelSpec(name=cls.lower(), version="1", path="", format="stage", handler=f"tgw.testing.generators:{cls}",
                     device="cpu", inputs=[IOSpec(name="prompt", dtype=prompt, shape=[-1] if prompt == "int64" else [])],
                     outputs=[IOSpec(name=out, dtype="int64", shape=[])], options=options or {}, generator=g)


def loaded(cls: str = "Counter", **kw):
    runner = make_runner(spec(cls, **kw), CPU)
    runner.warm_up()
    return runner


class Driver:
    """A StepLoop and what its Steps told, per sequence."""

    def __init__(self, runner):
        self.runner, self.loop = runner, StepLoop(runner)
        self.outputs: dict[int, list[int]] = {}
        self.positions: dict[int, list[int]] = {}
        self.ends: dict[int, object] = {}
        self.steps: list[Steps] = []

    def admit(self, seq: int, prompt, max_outputs: int = 0, **kw) -> None:
        sampling = Sampling(**{k: kw.pop(k) for k in list(kw) if k in Sampling.__struct_fields__})
        gs = GenSeq(seq=seq, max_outputs=max_outputs, sampling=sampling, **kw)
        row = prompt if isinstance(prompt, bytes) else torch.tensor(prompt)
        try:   # as the serving loop admits (generate/serving.py)
            s = sequence(self.runner, gs, 0, 1, {"prompt": row}, self.loop.tokens)
        except Refused as exc:
            self.loop.refuse(seq, exc.code, str(exc))
        else:
            self.loop.admit(s)

    def iterate(self) -> Steps | None:
        st = self.loop.iterate()
        if st is not None:
            self.steps.append(st)
            values = torch.frombuffer(bytearray(st.outputs[0].data), dtype=torch.int64).tolist() if st.seqs else []
            assert not st.seqs or st.outputs[0].shape == [len(st.seqs)]
            for q, pos, v in zip(st.seqs, st.positions, values):
                self.outputs.setdefault(q, []).append(v)
                self.positions.setdefault(q, []).append(pos)
            for e in st.ended:
                assert e.seq not in self.ends, f"sequence {e.seq} ended twice"
                self.ends[e.seq] = e
        return st

    def run(self, limit: int = 500) -> None:
        for _ in range(limit):
            if not self.loop.busy:
                return
            self.iterate()
        raise AssertionError("the loop never went idle")

    def reason(self, seq: int) -> str:
        return self.ends[seq].reason

    def error(self, seq: int):
        e = self.ends[seq]
        assert e.reason == "error" and e.error is not None, e
        return e.error


# ---- continuous batching ---------------------------------------------------------------------


def test_a_late_sequence_starts_before_the_early_ones_finish_and_slots_are_reused():
    d = Driver(loaded(max_sequences=2))
    d.admit(1, [1, 2, 3], max_outputs=10)
    d.admit(2, [5], max_outputs=3)
    first = d.iterate()
    assert first.prefilled == 2 and first.active == 2 and first.slots == 2
    d.iterate()
    d.iterate()   # sequence 2 emits its third output and ends: its slot is free again
    assert d.reason(2) == "max_outputs" and d.loop.free_slots == 1
    d.admit(3, [7, 7], max_outputs=4)
    st = d.iterate()
    assert st.prefilled == 1 and set(st.seqs) == {1, 3}   # 3's first output rides with 1's 4th
    assert 1 not in d.ends
    d.run()
    assert d.outputs == {1: counter_outputs([1, 2, 3], 10), 2: counter_outputs([5], 3), 3: counter_outputs([7, 7], 4)}
    assert d.positions[1] == list(range(10)) and d.loop.free_slots == 2 and not d.loop.live


def test_with_early_a_newcomers_first_output_goes_out_before_the_running_rows_step():
    """What the serving loop does: the prefill's Steps is handed over before the step runs."""
    d = Driver(loaded(max_sequences=2))
    d.admit(1, [1, 2, 3], max_outputs=10)
    d.iterate()
    d.admit(2, [5], max_outputs=3)
    early: list[Steps] = []
    st = d.loop.iterate(early=early.append)
    assert [(m.seqs, m.positions, m.prefilled) for m in early] == [([2], [0], 1)]
    assert st.seqs == [1] and st.positions == [1] and st.prefilled == 0
    alone = Driver(loaded(max_sequences=2))   # nothing running: one Steps, as without early
    alone.admit(1, [1, 2, 3], max_outputs=10)
    early.clear()
    st = alone.loop.iterate(early=early.append)
    assert not early and st.seqs == [1] and st.prefilled == 1


def test_prefill_takes_at_most_max_prefill_rows_a_step():
    d = Driver(loaded(max_sequences=4, max_prefill_rows=2))
    for q in range(3):
        d.admit(q, [q + 1], max_outputs=3)
    assert d.iterate().prefilled == 2
    st = d.iterate()
    assert st.prefilled == 1 and sorted(st.seqs) == [0, 1, 2]
    d.run()
    assert all(d.outputs[q] == counter_outputs([q + 1], 3) for q in range(3))


def test_the_pool_exhausted_refuses_at_once_without_touching_the_others():
    d = Driver(loaded(max_sequences=2))
    for q in range(3):
        d.admit(q, [q], max_outputs=2)
    d.iterate()
    err = d.error(2)
    assert err.code == Code.OVERLOADED.value and "no free state slot" in err.message and 2 not in d.outputs
    d.run()
    assert d.outputs == {0: counter_outputs([0], 2), 1: counter_outputs([1], 2)}


# ---- cancels ---------------------------------------------------------------------------------


def test_a_cancel_frees_the_slot_before_the_next_step_and_is_counted():
    d = Driver(loaded(max_sequences=2))
    d.admit(1, [1], max_outputs=50)
    d.admit(2, [2], max_outputs=50)
    d.iterate()
    d.loop.cancel([1, 99], "deadline")   # 99: not (or no longer) here, ignored
    st = d.iterate()
    assert st.seqs == [2] and [(e.seq, e.reason) for e in st.ended] == [(1, "deadline")]
    assert st.freed == 1 and st.active == 1 and d.loop.free_slots == 1
    d.admit(3, [3], max_outputs=2)      # the freed slot serves a newcomer
    d.loop.cancel([2])
    d.run()
    assert d.reason(2) == "cancelled" and d.steps[-1].freed == 2 and d.outputs[3] == counter_outputs([3], 2)


def test_cancelling_a_sequence_not_yet_prefilled_sends_only_its_end():
    d = Driver(loaded(max_sequences=2))
    d.admit(1, [1], max_outputs=5)
    d.loop.cancel([1])
    st = d.iterate()
    assert st.seqs == [] and st.outputs == [] and [e.reason for e in st.ended] == ["cancelled"] and st.freed == 1
    assert not d.loop.busy and d.loop.free_slots == 2


# ---- ends ------------------------------------------------------------------------------------


def test_stop_tokens_are_not_emitted_stop_sequences_are():
    base = counter_outputs([10], 10)   # 10, 11, 12, ...
    d = Driver(loaded(end_tokens=[14]))
    d.admit(1, [10], max_outputs=20)                          # the model's end token
    d.admit(2, [10], max_outputs=20, stop_tokens=[12])        # the request's
    d.admit(3, [10], max_outputs=20, stop_sequences=[[99], [12, 13]])
    d.run()
    assert (d.outputs[1], d.reason(1)) == (base[:4], "stop_token")
    assert (d.outputs[2], d.reason(2)) == (base[:2], "stop_token")
    assert (d.outputs[3], d.reason(3)) == (base[:4], "stop_sequence")


def test_done_and_max_outputs_end_after_emitting():
    d = Driver(loaded(options={"done_at": 2}))
    d.admit(1, [4], max_outputs=9)
    d.admit(2, [4], max_outputs=1)
    d.run()
    assert (d.outputs[1], d.reason(1)) == (counter_outputs([4], 3), "done")
    assert (d.outputs[2], d.reason(2)) == (counter_outputs([4], 1), "max_outputs")


def test_max_length_ends_after_the_last_position_and_refuses_a_prompt_that_does_not_fit():
    d = Driver(loaded(max_length=5))
    d.admit(1, [1, 1, 1], max_outputs=50)   # outputs sit at 3, 4, 5: a step from 4 would write position 4, then none
    d.admit(2, [1] * 5, max_outputs=50)     # fills it: its one output, from the prefill alone
    d.admit(3, [1] * 6, max_outputs=50)
    d.admit(4, [], max_outputs=50)
    d.run()
    assert "the prompt ('prompt') is empty" in d.error(4).message
    assert (len(d.outputs[1]), d.reason(1)) == (3, "max_length")
    assert (len(d.outputs[2]), d.reason(2)) == (1, "max_length")
    err = d.error(3)
    assert err.code == Code.INVALID_ARGUMENT.value and "6 position(s)" in err.message and "max_length is 5" in err.message
    assert 3 not in d.outputs and d.loop.free_slots == 4


def test_a_length_the_prefill_says_is_held_to_max_length_too():
    d = Driver(loaded(prompt="bytes", max_length=5))
    d.admit(1, b"abc", max_outputs=50)      # a bytes prompt's default length is 1: prefill says 3
    d.admit(2, b"abcdef", max_outputs=50)
    d.run()
    assert (d.outputs[1], d.reason(1)) == (counter_outputs(b"abc", 3), "max_length")
    err = d.error(2)
    assert "prefill said its prompt takes 6 position(s)" in err.message and 2 not in d.outputs


# ---- a handler that fails --------------------------------------------------------------------


def test_an_exception_in_prefill_ends_those_newcomers_only_naming_the_handlers_line(caplog):
    d = Driver(loaded(options={"raise_prefill_on": 13}, max_prefill_rows=2))
    d.admit(1, [1], max_outputs=4)
    d.iterate()
    d.admit(2, [13], max_outputs=4)
    d.admit(3, [3], max_outputs=4)   # prefilled in the same call as 2: it fails with it
    d.admit(4, [4], max_outputs=4)   # the next prefill: served
    d.run()
    for q in (2, 3):
        err = d.error(q)
        assert err.code == Code.MODEL_EXECUTION_ERROR.value
        assert "prefill raised ValueError: prefill refuses prompts starting with 13" in err.message
        assert f"{GENERATORS_FILE}:" in err.message
    assert d.outputs[1] == counter_outputs([1], 4) and d.outputs[4] == counter_outputs([4], 4)
    assert d.loop.free_slots == 4
    assert any(getattr(r, "event", None) == "generation_failed" for r in caplog.records)


def test_an_exception_in_step_ends_every_stepped_row_and_the_loop_goes_on():
    d = Driver(loaded(options={"raise_at": 2}))
    d.admit(1, [1], max_outputs=5)
    d.admit(2, [2], max_outputs=5)
    d.run()
    for q in (1, 2):
        err = d.error(q)
        assert "step raised RuntimeError: step refuses output 2" in err.message and f"{GENERATORS_FILE}:" in err.message
        assert d.outputs[q] == counter_outputs([q], 2)
    d.admit(3, [3], max_outputs=2)   # served after: one output from prefill, the step that raised not reached
    d.run()
    assert d.outputs[3] == counter_outputs([3], 2) and d.loop.free_slots == 4


def test_a_row_the_handler_fails_ends_with_its_message_and_a_bad_return_names_the_method():
    d = Driver(loaded(options={"fail_on": 8}))
    d.admit(1, [8], max_outputs=3)
    d.admit(2, [9], max_outputs=3)
    d.run()
    err = d.error(1)
    assert err.code == Code.INVALID_ARGUMENT.value and "prompt starts with 8" in err.message
    assert d.outputs[2] == counter_outputs([9], 3)
    d = Driver(loaded())
    d.runner.module.bad_return = "step"   # after the warm-up, which would have refused it
    d.admit(1, [1], max_outputs=3)
    d.run()
    err = d.error(1)
    assert "step returned 'value' float32 [1]; declared int64 [1]" in err.message and "Counter.step" in err.message


TWO_OUTPUTS = """
import torch

class Pair:
    def prefill(self, batch):
        for row, p in enumerate(batch["prompt"]):
            batch.state["at"][batch.slots[row]] = p.sum()
        at = batch.state["at"][batch.slots]
        return {"n": at, "vec": torch.stack([at.float(), -at.float()], 1)}

    def step(self, batch):
        at = batch.state["at"][batch.slots] + 1
        batch.state["at"][batch.slots] = at
        assert torch.equal(batch["vec"][:, 0], (at - 1).float())   # the last outputs come back as sent
        return {"n": at, "vec": torch.stack([at.float(), -at.float()], 1)}
"""


def test_a_generator_file_with_several_outputs_streams_each_by_name(tmp_path):
    (tmp_path / "pair.py").write_text(TWO_OUTPUTS)
    sp = ModelSpec(name="pair", version="1", path="", format="stage", handler=f"{tmp_path / 'pair.py'}:Pair",
                   device="cpu", inputs=[IOSpec(name="prompt", dtype="int64", shape=[-1])],
                   outputs=[IOSpec(name="n", dtype="int64", shape=[]), IOSpec(name="vec", dtype="float32", shape=[2])],
                   generator=GeneratorSpec(state=[StateSpec(name="at", dtype="int64", shape=[])], max_sequences=2))
    runner = make_runner(sp, CPU)
    runner.warm_up()
    loop = StepLoop(runner)
    for q, p in ((1, [1, 2]), (2, [10])):
        loop.admit(sequence(runner, GenSeq(seq=q, max_outputs=3), 0, 1, {"prompt": torch.tensor(p)}, loop.tokens))
    st = loop.iterate()
    n, vec = st.outputs
    assert (n.name, n.shape, vec.name, vec.dtype, vec.shape) == ("n", [2], "vec", "float32", [2, 2])
    assert torch.frombuffer(bytearray(vec.data), dtype=torch.float32).tolist() == [3, -3, 10, -10]
    st = loop.iterate()
    assert torch.frombuffer(bytearray(st.outputs[0].data), dtype=torch.int64).tolist() == [4, 11] and not st.ended
    d = Driver(runner)
    d.admit(3, [1], max_outputs=2, stop_tokens=[5])   # stop tokens need one integer scalar output
    d.iterate()
    assert "stop_tokens and stop_sequences need a generator whose one output is an integer scalar" in d.error(3).message


# ---- sampling and resumption ---------------------------------------------------------------------


def test_seeded_sampling_does_not_depend_on_batch_neighbours():
    prompts = {q: [q + 1, 2 * q + 3] for q in range(6)}
    params = {"temperature": 0.8, "top_k": 20, "top_p": 0.9}
    d = Driver(loaded("ToyLM", max_sequences=6, max_prefill_rows=2))
    for q, p in prompts.items():
        d.admit(q, p, max_outputs=8 + q, seed=100 + q, **params)
    d.run()
    for q, p in prompts.items():
        assert d.outputs[q] == toylm_reference(p, 8 + q, seed=100 + q, **params), q
    alone = Driver(loaded("ToyLM"))
    alone.admit(0, prompts[3], max_outputs=11, seed=103, **params)
    alone.run()
    assert alone.outputs[0] == d.outputs[3]


def test_a_resumed_sequence_continues_exactly():
    for cls, params in (("Counter", {}), ("ToyLM", {"temperature": 1.0, "seed": 7})):
        whole = Driver(loaded(cls))
        whole.admit(1, [3, 4], max_outputs=9, **params)
        whole.run()
        full = whole.outputs[1]
        out_dtype = torch.int64
        resumed = Driver(loaded(cls))
        resumed.admit(1, [3, 4], max_outputs=9, delivered=4,
                      prefix=[torch.tensor(full[:4], dtype=out_dtype).numpy().tobytes()], **params)
        resumed.run()
        assert resumed.outputs[1] == full[4:] and resumed.positions[1] == list(range(4, 9)), cls


def test_a_resumed_sequence_whose_delivered_outputs_had_ended_it_ends_so_without_an_output():
    """Its worker died after the last output went out and before the broker heard of the end:
    the resumption ends as the uninterrupted run did, emitting nothing more."""
    whole = Driver(loaded("Counter"))
    whole.admit(1, [3, 4], max_outputs=6)
    whole.admit(2, [3, 4], max_outputs=20, stop_sequences=[[9, 10]])
    whole.run()
    assert whole.ends[1].reason == "max_outputs" and whole.ends[2].reason == "stop_sequence"
    limited = Driver(loaded("Counter", max_length=5))   # a prompt of 2: outputs 0..3, the 4th would not fit
    limited.admit(4, [3, 4], max_outputs=20)
    limited.run()
    assert limited.ends[4].reason == "max_length"
    for d, seq, full, kw in ((Driver(loaded("Counter")), 1, whole.outputs[1], {"max_outputs": 6}),
                             (Driver(loaded("Counter")), 2, whole.outputs[2], {"max_outputs": 20,
                                                                               "stop_sequences": [[9, 10]]}),
                             (Driver(loaded("Counter", max_length=5)), 4, limited.outputs[4], {"max_outputs": 20})):
        d.admit(seq, [3, 4], delivered=len(full), prefix=[torch.tensor(full, dtype=torch.int64).numpy().tobytes()],
                **kw)
        d.run()
        assert d.outputs.get(seq, []) == [] and d.ends[seq].reason == whole.ends.get(seq, limited.ends.get(seq)).reason


# ---- the load --------------------------------------------------------------------------------


def test_slots_from_state_memory_and_a_pool_that_holds_none_fails_the_load_with_the_arithmetic():
    runner = loaded(state_memory=24 * 10 + 5)
    assert runner.slots == 10 and runner.nbytes == 240 and runner.state["acc"].shape == (10, 3)
    with pytest.raises(GeneratorLoadError, match=r"state_memory of 20 bytes holds 0 slots: one sequence's state "
                                                 r"is 24 bytes \(acc int64 \[3\] = 24 bytes\)"):
        make_runner(spec(state_memory=20), CPU)


def test_a_warm_up_that_raises_or_returns_the_wrong_thing_fails_the_load():
    with pytest.raises(GeneratorProofError, match=r"warm-up prefill returned 'value' float32 \[1, 2\]; declared "
                                                  r"int64 \[1\].*Counter.prefill"):
        loaded(options={"bad_return": "prefill"})
    with pytest.raises(GeneratorProofError, match=rf"warm-up step raised RuntimeError: step refuses output 1 "
                                                  rf"\(at {GENERATORS_FILE}:\d+\)"):
        loaded(options={"raise_at": 1})
    example = spec(options={"raise_prefill_on": 7})   # zeros would pass: the example is what is tried
    example.warmup_inputs = [{"prompt": [7, 1]}]
    with pytest.raises(GeneratorProofError, match="prefill refuses prompts starting with 7"):
        make_runner(example, CPU).warm_up()
    example.warmup_inputs = [{"prompt": [6, 1]}]
    make_runner(example, CPU).warm_up()


def test_the_loader_tells_the_slots_and_counts_the_pool_and_refuses_a_generator_that_fails_warm_up():
    side = LoaderSide()
    try:
        side.recv()   # its hello: from now on the router can address it
        side.send(encode(LoadModel(spec=spec(max_sequences=3))))
        reply = side.recv()
        assert isinstance(reply, ModelLoaded) and reply.error is None, reply
        assert reply.slots == 3 and reply.bytes == 3 * 24 and reply.footprint.weights >= 72
        assert isinstance(side.runners["counter:1"].state["acc"], torch.Tensor)
        bad = spec(options={"raise_prefill_on": 0})
        bad.name = "bad"
        side.send(encode(LoadModel(spec=bad)))
        reply = side.recv()
        assert reply.reason == "warmup" and reply.slots == 0 and "bad:1" not in side.runners
        assert "warm-up prefill raised ValueError" in reply.error and f"{GENERATORS_FILE}:" in reply.error
    finally:
        side.close()


# ---- through the serving loop ------------------------------------------------------------------


class Broker:
    """Server.serve() in a thread on a DEALER; this side plays the broker on a ROUTER."""
    IDENTITY = b"w0.0"

    def __init__(self, runners: dict):
        self.segment = Segment.create(new_name("ring"), 128 << 10)
        self.ctx = zmq.Context()
        self.router, self.dealer = self.ctx.socket(zmq.ROUTER), self.ctx.socket(zmq.DEALER)
        self.router.bind(f"inproc://tgw-gen-{id(self)}")
        self.dealer.setsockopt(zmq.IDENTITY, self.IDENTITY)
        self.dealer.connect(f"inproc://tgw-gen-{id(self)}")
        self.dealer.send(encode(WorkerHello(v=PROTOCOL_VERSION, worker_id=0, pid=os.getpid())))
        assert self.router.poll(int(WAIT_S * 1000))
        self.router.recv_multipart()
        self.server = Server(self.dealer, self.segment, 64 << 10, 64 << 10, runners)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        self.ids, self.next_in = itertools.count(1), 0

    def _serve(self):
        try:
            self.server.serve()
        except BaseException as exc:
            self.error = exc

    def send(self, msg) -> None:
        self.router.send_multipart([self.IDENTITY, encode(msg)])

    def lay(self, data: bytes) -> int:
        block = self.next_in
        self.next_in += aligned_total([len(data)])
        self.segment.buf[block:block + len(data)] = data
        return block

    def generate(self, model: str, prompts: list, seqs: list[int], max_outputs: int) -> Batch:
        """One admission batch, one row a prompt, laid in the input arena: equal-length int64
        prompts, or bytes prompts (a bytes input: their lengths may differ)."""
        as_bytes = isinstance(prompts[0], bytes)
        data = pack(prompts) if as_bytes else torch.tensor(prompts, dtype=torch.int64).numpy().tobytes()
        block = self.lay(data)
        shape = [len(prompts)] if as_bytes else [len(prompts), len(prompts[0])]
        batch = Batch(batch_id=next(self.ids), model=model, version="1", rows=len(prompts), block=block,
                      inputs=[BlockTensor(name="prompt", dtype="bytes" if as_bytes else "int64", shape=shape,
                                          offset=block, nbytes=len(data))],
                      splits=[1] * len(prompts), sequences=[GenSeq(seq=q, max_outputs=max_outputs) for q in seqs])
        self.send(batch)
        return batch

    def recv(self):
        deadline = time.monotonic() + WAIT_S
        while not self.router.poll(50):
            assert self.thread.is_alive(), f"serve() ended: {self.error!r}"
            assert time.monotonic() < deadline, "no message from the worker"
        return from_worker_decoder.decode(self.router.recv_multipart()[1])

    def close(self):
        self.send(Stop())
        self.thread.join(WAIT_S)
        alive = self.thread.is_alive()
        self.router.close(linger=0)
        if not alive:
            self.dealer.close(linger=0)
            self.ctx.term()
            self.segment.close()
        self.segment.unlink()
        assert not alive and self.error is None, self.error


def test_through_the_serving_loop_a_batch_is_answered_at_once_then_streamed_and_cancelled():
    runner = loaded(max_sequences=3)
    b = Broker({runner.key: runner})
    try:
        batch = b.generate("counter", [[1, 2], [3, 4]], [10, 11], max_outputs=1000)
        done = b.recv()
        assert isinstance(done, Done) and done.batch_id == batch.batch_id and done.error is None and not done.outputs
        got: dict[int, list[int]] = {}
        cancelled = None
        while cancelled is None:
            st = b.recv()
            assert isinstance(st, Steps) and st.key == "counter:1" and st.slots == 3
            values = torch.frombuffer(bytearray(st.outputs[0].data), dtype=torch.int64).tolist() if st.seqs else []
            for q, v in zip(st.seqs, values):
                got.setdefault(q, []).append(v)
            if len(got.get(10, [])) == 3:
                b.send(CancelSequences(seqs=[10]))
            ended = {e.seq: e for e in st.ended}
            if 10 in ended:
                cancelled = st
        assert ended[10].reason == "cancelled" and cancelled.freed == 1 and 10 not in cancelled.seqs
        n = len(got[10])
        assert got[10] == counter_outputs([1, 2], n) and got[11] == counter_outputs([3, 4], len(got[11]))
        b.send(CancelSequences(seqs=[11], reason="client_closed"))
        while True:   # the rest of 11's outputs, then its end
            st = b.recv()
            if st.ended:
                assert [(e.seq, e.reason) for e in st.ended] == [(11, "client_closed")] and st.active == 0
                break
    finally:
        b.close()


def values_of(st: Steps) -> dict[int, int]:
    return dict(zip(st.seqs, torch.frombuffer(bytearray(st.outputs[0].data), dtype=torch.int64).tolist())) \
        if st.seqs else {}


def test_an_ordinary_batch_is_served_between_steps_and_an_unload_ends_the_live_sequences():
    runner = loaded(max_sequences=2, options={"step_ms": 1})
    stage = StageRunner(ModelSpec(name="addone", version="1", path="", format="stage", device="cpu",
                                  handler=f"{os.path.abspath(stages.__file__)}:AddOne",
                                  inputs=[IOSpec(**t) for t in stages.X_IN],
                                  outputs=[IOSpec(**t) for t in stages.Y_OUT]), CPU)
    b = Broker({runner.key: runner, stage.key: stage})
    try:
        b.generate("counter", [[5]], [1], max_outputs=100_000)
        assert isinstance(b.recv(), Done)
        assert values_of(b.recv()) == {1: 5}
        x = np.arange(4, dtype=np.float32)[None]
        ordinary = Batch(batch_id=next(b.ids), model="addone", version="1", rows=1, block=0,
                         inputs=[BlockTensor(name="x", dtype="float32", shape=[1, 4], offset=b.lay(x.tobytes()),
                                             nbytes=x.nbytes)], splits=[1])
        b.send(ordinary)
        got = [5]
        while True:   # the sequence streams on until the stage's answer, and after it
            msg = b.recv()
            if isinstance(msg, Done):
                assert msg.batch_id == ordinary.batch_id and msg.error is None
                np.testing.assert_array_equal(block_view(b.segment.buf, msg.outputs[0]), x + 1)
                break
            got.append(values_of(msg)[1])
        after = b.recv()
        assert isinstance(after, Steps) and not after.ended
        got.append(values_of(after)[1])
        assert got == counter_outputs([5], len(got))
        b.server.runners.pop(runner.key)   # as the loader unloads it
        while not (st := b.recv()).ended:
            pass
        assert st.ended[0].seq == 1 and st.ended[0].error.code == Code.MODEL_NOT_READY.value and st.active == 0
    finally:
        b.close()


def test_bytes_prompts_of_different_lengths_are_taken_from_the_ring():
    runner = loaded(prompt="bytes")
    b = Broker({runner.key: runner})
    try:
        b.generate("counter", [b"hello", b"tgw!!!!"], [1, 2], max_outputs=3)
        assert isinstance(b.recv(), Done)
        got: dict[int, list[int]] = {}
        ends = {}
        while len(ends) < 2:
            st = b.recv()
            for q, v in values_of(st).items():
                got.setdefault(q, []).append(v)
            ends.update({e.seq: e.reason for e in st.ended})
        assert got == {1: counter_outputs(b"hello", 3), 2: counter_outputs(b"tgw!!!!", 3)}
        assert ends == {1: "max_outputs", 2: "max_outputs"}
    finally:
        b.close()
