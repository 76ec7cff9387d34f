"""Sequence models on their worker (workers/sequence_runner.py, sequence.py, slot_pool.py)
in-process: the demo's accumulator (a TorchScript file written for Triton's PyTorch backend) and
tiny-rnn (a handler class) loaded by the real Loader, their batches run by Server.run_batch over a
real segment with Batch.steps as the broker sends them. Interleaved sequences batched together,
start resets, state isolation between slots, control inputs and Triton's input naming, row
failures, and the warm-up's refusals."""
from __future__ import annotations

import inspect
import os

import numpy as np
import pytest
import torch

import sequence_handlers
from conftest import readme_block
from test_stage_loop import Rig
from test_worker_loader import LoaderSide

from tgw.broker.config.load import ModelDecl
from tgw.broker.models.entry import sequence_spec
from tgw.shm.wire import IOSpec, ModelSpec, SeqStep
from tgw.workers.demo_sequence import Accumulator, build_sequence_decls, make_cell
from tgw.workers.sequence_runner import SequenceProofError
from tgw.workers.slot_pool import PoolSizeError
from tgw.workers.stage_runner import StageLoadError, make_runner

CPU = torch.device("cpu")
HANDLERS = os.path.abspath(sequence_handlers.__file__)


def spec_of(name: str, m: dict) -> ModelSpec:
    """A demo-style declaration through the config's validation, as the broker specs it."""
    version = {"handler": m["handler"]} if "handler" in m else {"path": m["path"]}
    extra = {"device": "cpu", "options": m.get("options", {})} if "handler" in m else {}
    decl = ModelDecl.model_validate({"name": name, "versions": [{"version": "1", **version}], "inputs": m["inputs"],
                                     "outputs": m["outputs"], "max_batch_size": 64,
                                     "sequence_batching": m["sequence_batching"], **extra})
    return ModelSpec(name=name, version="1", path=m.get("path", ""), handler=m.get("handler", ""),
                     format="stage" if "handler" in m else "torchscript", device=extra.get("device", ""),
                     options=m.get("options", {}), inputs=[IOSpec(**t) for t in m["inputs"]],
                     outputs=[IOSpec(**t) for t in m["outputs"]], sequence=sequence_spec(decl.sequence_batching))


class Stepper:
    """Batches of sequence steps through a Server: each request one row, its step in Batch.steps."""

    def __init__(self, runners: dict):
        self.rig, self.blocks = Rig(runners), []

    def run(self, runner, inputs: dict, steps: list[SeqStep], splits: list[int] | None = None):
        batch = self.rig.batch(runner, inputs, splits or [1] * len(steps))
        batch.steps, batch.release, self.blocks = steps, self.blocks, []
        done = self.rig.server.run_batch(batch)
        if done.block is not None:
            self.blocks.append(done.block)
        return done

    def values(self, runner, inputs: dict, steps: list[SeqStep]) -> dict[str, np.ndarray]:
        done = self.run(runner, inputs, steps)
        assert done.error is None, done.error
        return {t.name: self.rig.read(t) for t in done.outputs}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo's two sequence models, loaded by the real Loader (its ModelLoaded kept)."""
    decls = build_sequence_decls(str(tmp_path_factory.mktemp("seq")))
    side = LoaderSide()
    side.recv()   # its hello: the router can address it from now on
    stepper = None
    try:
        loaded = {name: side.load(spec_of(name, m)) for name, m in decls.items()}
        stepper = Stepper(dict(side.runners))
        yield side.runners, loaded, stepper
    finally:
        # closed, not left to the collector: a zmq Context collected with its sockets open blocks
        # in term(), in whichever thread collects it (a later test's worker thread hung on one)
        if stepper is not None:
            stepper.rig.close()
        side.close()


def steps(*rows) -> list[SeqStep]:
    return [SeqStep(slot=s, corrid=c, start="S" in f, end="E" in f) for s, c, f in rows]


def test_the_accumulator_keeps_interleaved_sequences_apart_and_resets_a_slot_at_start(demo):
    runners, loaded, st = demo
    acc = runners["accumulator:1"]
    reply = loaded["accumulator"]
    assert reply.error is None and reply.slots == 64 and reply.bytes >= 64 * 4   # the pool counts in its bytes
    assert [t.name for t in acc.inner.spec.inputs] == ["INPUT", "START", "END", "READY", "INPUT_STATE"]

    def go(values, *rows):
        return st.values(acc, {"INPUT": np.array([[v] for v in values], np.int32)}, steps(*rows))["OUTPUT"].ravel()

    assert go([3, 9], (3, 11, "S"), (5, 22, "S")).tolist() == [3, 9]        # two sequences, one batch
    assert go([2, 1], (5, 22, ""), (3, 11, "")).tolist() == [11, 4]         # other row order
    assert go([4], (3, 11, "E")).tolist() == [8]                            # alone, ending
    assert go([7, 5], (3, 33, "S"), (5, 22, "")).tolist() == [7, 16]        # slot 3 reused: starts from 0
    pool = acc.state["INPUT_STATE"]
    assert pool[3].item() == 7 and pool[5].item() == 16 and int(pool.sum()) == 23   # no other slot touched
    # a batch whose steps do not match its rows (a request of 2 rows) fails whole, the state left as it was
    bad = st.run(acc, {"INPUT": np.array([[1], [1]], np.int32)}, steps((3, 33, "")), splits=[2])
    assert bad.error is not None and "2 rows came with 1 sequence steps" in bad.error.message
    assert pool[3].item() == 7


def test_tiny_rnn_handler_steps_each_sequence_as_its_own_gru_run(demo):
    runners, loaded, st = demo
    rnn = runners["tiny-rnn:1"]
    assert loaded["tiny-rnn"].slots == 64
    cell = make_cell(7)
    xs = {c: torch.randn(4, 4, generator=torch.Generator().manual_seed(c)) for c in (1, 2, 3)}
    hidden = {c: torch.zeros(1, 8) for c in xs}
    slot = {1: 9, 2: 0, 3: 63}
    for k, order in enumerate([[1, 2, 3], [3, 1], [2, 3, 1], [1, 2, 3]]):
        rows = steps(*((slot[c], c, "S" if k == 0 or (c == 2 and k == 2) else "") for c in order))
        if k == 2:
            hidden[2] = torch.zeros(1, 8)   # sequence 2 restarts in its slot
        y = st.values(rnn, {"x": torch.stack([xs[c][k] for c in order]).numpy()}, rows)["y"]
        with torch.no_grad():
            for row, c in enumerate(order):
                hidden[c] = cell(xs[c][k:k + 1], hidden[c])
                np.testing.assert_allclose(y[row], hidden[c][0].numpy(), rtol=1e-5, atol=1e-6)


def exported_accumulator(path: str) -> str:
    """The demo accumulator as a torch.export program (its placeholders' names lowercased by torch)."""
    from torch.export import Dim
    batch = Dim("batch", min=1, max=64)
    ep = torch.export.export(Accumulator(), tuple(torch.zeros(2, 1, dtype=torch.int32) for _ in range(5)),
                             dynamic_shapes=tuple({0: batch} for _ in range(5)))
    torch.export.save(ep, path)
    return path


def test_controls_follow_tritons_names_and_indices_and_a_handler_fails_single_rows(tmp_path):
    path = sequence_handlers.script(sequence_handlers.Indexed(), str(tmp_path / "indexed.pt"))
    indexed = spec_of("indexed", {
        "path": path, "inputs": [{"name": "X__0", "dtype": "float32", "shape": [1]}],
        "outputs": [{"name": "OUT__1", "dtype": "int64", "shape": [1]}],
        "sequence_batching": {"max_sequences": 4, "control_inputs": [
            {"name": "READY__2", "kind": "ready", "dtype": "int64"}, {"name": "CORRID__1", "kind": "corrid",
                                                                      "dtype": "int64"}],
            "state": [{"name": "S__3", "output": "S_NEXT__0", "dtype": "int64", "shape": [1], "initial": 100}]}})
    counter = spec_of("counter", {
        "handler": f"{HANDLERS}:Counter", "inputs": [{"name": "x", "dtype": "float32", "shape": [1]}],
        "outputs": [{"name": "steps", "dtype": "int64", "shape": [1]}, {"name": "corrid", "dtype": "int64", "shape": [1]}],
        "sequence_batching": {"state_memory_mb": 0.0001, "state": [{"name": "n", "dtype": "int64", "shape": [1]}]}})
    exported = spec_of("exported", {
        "path": exported_accumulator(str(tmp_path / "acc.pt2")), "inputs": [{"name": "INPUT", "dtype": "int32",
                                                                            "shape": [1]}],
        "outputs": [{"name": "OUTPUT", "dtype": "int32", "shape": [1]}],
        "sequence_batching": {"max_sequences": 4, "control_inputs": [   # in another order than forward's
            {"name": n, "kind": n.lower()} for n in ("READY", "END", "START")],
            "state": [{"name": "INPUT_STATE", "output": "OUTPUT_STATE", "dtype": "int32", "shape": [1]}]}})
    exported.format = "export"
    runners = {f"{s.name}:1": make_runner(s, CPU) for s in (indexed, counter, exported)}
    for r in runners.values():
        r.warm_up()
    assert [t.name for t in runners["indexed:1"].inner.spec.inputs] == ["X__0", "CORRID__1", "READY__2", "S__3"]
    assert runners["counter:1"].slots == 13   # 0.0001 MiB of 8-byte states
    assert [t.name for t in runners["exported:1"].inner.spec.inputs] == ["INPUT", "START", "END", "READY",
                                                                         "INPUT_STATE"]
    st = Stepper(runners)
    try:
        big = (1 << 64) - 1   # a uint64 id past int64's range reaches an int64 CORRID with its bits kept
        ids = st.values(runners["indexed:1"], {"X__0": np.zeros((2, 1), np.float32)}, steps((0, big, "S"), (2, 5, "S")))
        assert ids["OUT__1"].ravel().tolist() == [-1, 5]
        st.values(runners["indexed:1"], {"X__0": np.zeros((1, 1), np.float32)}, steps((2, 5, "")))
        assert runners["indexed:1"].state["S__3"].ravel().tolist() == [101, 100, 102, 100]   # READY 1 per step
        acc = runners["exported:1"]
        for values, rows, want in (([3, 4], steps((1, 1, "S"), (2, 2, "S")), [3, 4]), ([5], steps((2, 2, "E")), [9])):
            out = st.values(acc, {"INPUT": np.array([[v] for v in values], np.int32)}, rows)["OUTPUT"]
            assert out.ravel().tolist() == want
        c = runners["counter:1"]
        out = st.values(c, {"x": np.array([[1], [1]], np.float32)}, steps((12, 7, "S"), (0, 8, "S")))
        assert out["steps"].ravel().tolist() == [1, 1] and out["corrid"].ravel().tolist() == [7, 8]
        done = st.run(c, {"x": np.array([[1], [-1]], np.float32)}, steps((12, 7, ""), (0, 8, "")))
        assert done.error is None and list(done.failed) == [1] and "negative" in done.failed[1].message
    finally:
        st.rig.close()


def test_the_load_refuses_a_model_that_breaks_its_sequence_declaration(tmp_path):
    one = sequence_handlers.script(sequence_handlers.OneOutput(), str(tmp_path / "one.pt"))
    file_decl = {"path": one, "inputs": [{"name": "INPUT", "dtype": "int32", "shape": [1]}],
                 "outputs": [{"name": "OUTPUT", "dtype": "int32", "shape": [1]}],
                 "sequence_batching": {"max_sequences": 2, "state": [
                     {"name": "INPUT_STATE", "output": "OUTPUT_STATE", "dtype": "int32", "shape": [1]}]}}
    with pytest.raises(SequenceProofError, match=r"model returned 1 tensors, 2 outputs are declared \['OUTPUT', "
                       r"'OUTPUT_STATE'\]; a model file returns its declared outputs \['OUTPUT'\], then each "
                       r"state's next value \['OUTPUT_STATE'\]"):
        make_runner(spec_of("one", file_decl), CPU).warm_up()
    file_decl["path"] = sequence_handlers.script(sequence_handlers.WrongState(), str(tmp_path / "wrong.pt"))
    with pytest.raises(SequenceProofError, match=r"output 'OUTPUT_STATE' is float64, declared int32"):
        make_runner(spec_of("wrong", file_decl), CPU).warm_up()

    def handler(cls: str, **sb) -> ModelSpec:
        return spec_of(cls.lower(), {"handler": f"{HANDLERS}:{cls}", "inputs": [{"name": "x", "dtype": "float32",
                                                                               "shape": [1]}],
                                     "outputs": [{"name": "steps", "dtype": "int64", "shape": [1]}],
                                     "sequence_batching": {"state": [{"name": "n", "dtype": "int64", "shape": [64]}],
                                                           **(sb or {"max_sequences": 2})}})

    with pytest.raises(SequenceProofError, match=r"warm-up step raised RuntimeError: no state today \(at "
                       r".*sequence_handlers.py:\d+"):
        make_runner(handler("RaisingStep"), CPU).warm_up()
    with pytest.raises(StageLoadError, match="NoStep has no step"):
        make_runner(handler("NoStep"), CPU)
    with pytest.raises(PoolSizeError, match="holds 0 slots: one sequence's state is 512 bytes"):
        make_runner(handler("Counter", state_memory_mb=0.0001), CPU)


def test_the_docs_handler_is_the_demos_code():
    """docs/SEQUENCES-MODEL.md's tiny-rnn is workers/demo_sequence.py's, line for line."""
    from tgw.workers import demo_sequence
    source = inspect.getsource(demo_sequence.TinyRNN).splitlines()
    excerpt = [line for line in readme_block("sequence-example:handler").splitlines() if line.strip()]
    assert excerpt == [line for line in source if line.strip() and '"""' not in line]
