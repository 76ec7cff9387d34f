"""Stages in the worker's serving loop (workers/stage_serve.py, stage_runner.py, stage_outputs.py)
in-process: real handler classes (tests/stages.py, loaded by file path as a worker loads them),
a real segment, Server.run_batch driven as the broker drives it. Bytes in and out, row
failures as Done.failed, outputs checked against the declaration, parts at request boundaries,
options and the setup context, and handlers that cannot load."""
from __future__ import annotations

import itertools
import os
import threading

import numpy as np
import pytest
import torch
import zmq

import stages
from tgw.shm.bytes_tensor import pack, unpack
from tgw.shm.errors import Code
from tgw.shm.ring import aligned_total
from tgw.shm.segment import Segment, new_name
from tgw.shm.wire import Batch, BlockTensor, Done, IOSpec, ModelSpec, Release, encode, from_worker_decoder
from tgw.workers.runner import ChecksumMismatch
from tgw.workers.serve import Server
from tgw.workers.stage_outputs import StageOutputError, host_outputs
from tgw.workers.stage_runner import StageLoadError, StageRunner, load_class, make_runner

HANDLER = os.path.abspath(stages.__file__)
IN_BYTES = 64 << 10
WAIT_S = 10.0


def spec(cls: str, name: str | None = None, **fields) -> ModelSpec:
    io = {k: [IOSpec(**t) for t in stages.STAGES[cls][k]] for k in ("inputs", "outputs")}
    return ModelSpec(name=name or cls.lower(), version="1", path="", format="stage", handler=f"{HANDLER}:{cls}",
                     device="cpu", **io, **fields)


class Rig:
    """A Server over a fresh segment; batches run with run_batch, parts read off a ROUTER."""

    def __init__(self, runners: dict, output_bytes: int = 64 << 10):
        self.segment = Segment.create(new_name("ring"), IN_BYTES + output_bytes)
        self.ctx = zmq.Context()
        self.router, dealer = self.ctx.socket(zmq.ROUTER), self.ctx.socket(zmq.DEALER)
        endpoint = f"inproc://tgw-stage-{id(self)}"
        self.router.bind(endpoint)
        dealer.setsockopt(zmq.IDENTITY, b"w0.0")
        dealer.connect(endpoint)
        self.dealer = dealer
        self.server = Server(dealer, self.segment, IN_BYTES, output_bytes, runners)
        self.ids = itertools.count(1)
        self.parts_read: list[list] = []

    def batch(self, runner: StageRunner, inputs: dict, splits: list[int]) -> Batch:
        """Lay `inputs` (name -> list of bytes rows, or an ndarray) in the input arena."""
        pos, tensors = 0, []
        for decl in runner.spec.inputs:
            value = inputs[decl.name]
            if decl.dtype == "bytes":
                flat = [e for row in value for e in (row if isinstance(row, list) else [row])]
                data = pack(flat)
                shape = [len(value), *([len(value[0])] if value and isinstance(value[0], list) else [])]
            else:
                data, shape = value.tobytes(), list(value.shape)
            self.segment.buf[pos:pos + len(data)] = data
            tensors.append(BlockTensor(name=decl.name, dtype=decl.dtype, shape=shape, offset=pos, nbytes=len(data)))
            pos += aligned_total([len(data)])
        return Batch(batch_id=next(self.ids), model=runner.spec.name, version="1", rows=sum(splits), block=0,
                     inputs=tensors, splits=splits)

    def run(self, runner: StageRunner, inputs: dict, splits: list[int]) -> list[Done]:
        """Every part of the batch's completion, in order (the last returned by run_batch); each
        part sent on the way is read into `self.parts_read`, then its block released, as the
        broker does."""
        batch = self.batch(runner, inputs, splits)
        result: list = []
        thread = threading.Thread(target=lambda: result.append(self.server.run_batch(batch)), daemon=True)
        thread.start()
        parts = []
        while thread.is_alive() or self.router.poll(0):
            if self.router.poll(50):
                part = from_worker_decoder.decode(self.router.recv_multipart()[1])
                parts.append(part)
                self.parts_read.append([self.read(t) for t in part.outputs])
                self.router.send_multipart([b"w0.0", encode(Release(blocks=[part.block]))])
        thread.join(WAIT_S)
        return parts + result

    def read(self, t: BlockTensor):
        buf = self.segment.buf
        if t.dtype == "bytes":
            return [unpack(buf[t.offset + a:t.offset + b], int(np.prod(t.shape[1:])))
                    for a, b in zip(t.cuts, t.cuts[1:])]
        return np.frombuffer(buf, dtype=t.dtype, count=int(np.prod(t.shape)), offset=t.offset).reshape(t.shape).copy()

    def close(self) -> None:
        self.server.close()
        self.router.close(0)
        self.dealer.close(0)
        self.ctx.term()
        self.segment.close()
        self.segment.unlink()


@pytest.fixture(scope="module")
def runners() -> dict[str, StageRunner]:
    made = [make_runner(spec(c), torch.device("cpu")) for c in ("Echo", "RowFails", "AddOne", "WrongOutput")]
    made.append(make_runner(spec("Tagged", options={"tag": "!"}), torch.device("cpu")))
    for r in made:
        r.warm_up()
    return {r.key: r for r in made}


@pytest.fixture
def rig(runners):
    r = Rig(runners)
    yield r
    r.close()


def test_bytes_in_and_out(rig, runners):
    echo = runners["echo:1"]
    [done] = rig.run(echo, {"data": [b"a", b"", b"hello"]}, [2, 1])
    assert done.error is None and not done.failed and done.final
    data, length = done.outputs
    assert data.dtype == "bytes" and data.shape == [3] and len(data.cuts) == 4
    assert [row[0] for row in rig.read(data)] == [b"a", b"", b"hello"]
    assert rig.read(length).tolist() == [1, 0, 5]


def test_a_failed_row_fails_its_request_only(rig, runners):
    rows = [b"one", b"two", b"bad apple", b"four"]
    [done] = rig.run(runners["rowfails:1"], {"data": rows}, [1, 1, 1, 1])
    assert done.error is None and list(done.failed) == [2]
    err = done.failed[2]
    assert err.code == Code.INVALID_ARGUMENT.value
    assert err.message == "stage rowfails: row 2 starts with 'bad': b'bad apple'"
    assert err.details["row"] == 0 and err.details["request"] == 2
    assert [r[0] for r in rig.read(done.outputs[0])] == rows   # the outputs still carry every row


def test_fixed_dtypes_and_options(rig, runners):
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    [done] = rig.run(runners["addone:1"], {"x": x}, [2])
    np.testing.assert_array_equal(rig.read(done.outputs[0]), x + 1)
    [done] = rig.run(runners["tagged:1"], {"data": [b"x"]}, [1])
    data, context = (rig.read(t) for t in done.outputs)
    assert data == [[b"x!"]]
    assert context[0][0].decode() == f"tagged|1|tests|cpu|{torch.get_num_threads()}|warmed=True"


def test_wrong_output_fails_the_batch_naming_stage_and_output(rig, runners):
    [done] = rig.run(runners["wrongoutput:1"], {"x": np.zeros((1, 4), np.float32)}, [1])
    assert done.error.code == Code.MODEL_EXECUTION_ERROR.value
    assert "stage wrongoutput version 1: output 'y' is float64, declared float32" in done.error.message


def test_parts_carry_the_failures_of_their_requests(runners):
    """An output arena of 4 KiB holds two 1.5 KiB rows: four requests answer in two parts, and
    the failed request's error goes with the part that holds it."""
    rig = Rig(runners, output_bytes=4096)
    try:
        rows = [bytes([65 + k]) * 1500 for k in range(4)]
        rows[3] = b"bad" + rows[3][3:]
        parts = rig.run(runners["rowfails:1"], {"data": rows}, [1, 1, 1, 1])
        assert [(p.first, p.count, p.final) for p in parts] == [(0, 2, False), (2, 2, True)]
        assert [list(p.failed) for p in parts] == [[], [3]]
        read = rig.parts_read + [[rig.read(t) for t in parts[-1].outputs]]
        assert [row[0] for outputs in read for row in outputs[0]] == rows
    finally:
        rig.close()


def test_nested_bytes_rows(runners, tmp_path):
    handler = tmp_path / "pairs.py"
    handler.write_text("class Swap:\n    def __call__(self, batch):\n"
                       "        return {'out': [[b, a] for a, b in batch['pair']]}\n")
    io = {"inputs": [IOSpec(name="pair", dtype="bytes", shape=[2])],
          "outputs": [IOSpec(name="out", dtype="bytes", shape=[2])]}
    swap = StageRunner(ModelSpec(name="swap", version="1", path="", format="stage", handler=f"{handler}:Swap", **io),
                       torch.device("cpu"))
    rig = Rig({swap.key: swap})
    try:
        [done] = rig.run(swap, {"pair": [[b"a", b"b"], [b"c", b"d"]]}, [1, 1])
        assert done.outputs[0].shape == [2, 2]
        assert rig.read(done.outputs[0]) == [[b"b", b"a"], [b"d", b"c"]]
    finally:
        rig.close()


def test_outputs_checked_against_the_declaration():
    decls = [IOSpec(name="s", dtype="bytes", shape=[-1]), IOSpec(name="n", dtype="int64", shape=[])]
    s, n = host_outputs("stage t", decls, ([["a", b"b"], ["c", "d"]], np.array([1, 2])), 2)
    assert s.shape == [2, 2] and n.tolist() == [1, 2]
    for result, why in [({"s": [[b"a"]]}, "missing declared outputs ['n']"),
                        (([[b"a"], [b"b", b"c"]], np.array([1, 2])), "row 1: dims [2], row 0 has [1]"),
                        (([[b"a"]], np.array([1, 2])), "is 1 rows; a bytes output is a list of 2 rows"),
                        (([[1], [2]], np.array([1, 2])), "row 0[0]: an element is int, not bytes or str"),
                        (([[b"a"], [b"b"]], np.array([1.0, 2.0])), "output 'n' is a numpy array of float64"),
                        (([[b"a"], [b"b"]], [1, 2]), "output 'n' is list; a int64 output is a torch tensor")]:
        with pytest.raises(StageOutputError, match=None) as info:
            host_outputs("stage t", decls, result, 2)
        assert why in str(info.value), (why, str(info.value))


def test_handlers_that_cannot_load(tmp_path):
    with pytest.raises(StageLoadError, match="'Nope' is not defined there"):
        load_class(f"{HANDLER}:Nope")
    with pytest.raises(StageLoadError, match="'STAGES' is not a class"):
        load_class(f"{HANDLER}:STAGES")
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('no GPU here')\nclass S: pass\n")
    with pytest.raises(StageLoadError, match="failed to import: RuntimeError: no GPU here"):
        load_class(f"{broken}:S")
    with pytest.raises(ChecksumMismatch):
        load_class(f"{HANDLER}:Echo", sha256="0" * 64)
    with pytest.raises(StageLoadError, match="handler module 'no_such_module_tgw' cannot be imported"):
        load_class("no_such_module_tgw:S")
    assert load_class("stages:Echo").__name__ == "Echo"   # a module on sys.path
