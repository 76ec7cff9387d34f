"""The worker's loader (workers/loader.py) in-process: a ROUTER on inproc:// plays the broker's
loader side; loads, each kind of failed load, unloads, bad messages, stop. Then the runner's byte
count, the start-up load's sizes, and in a fresh interpreter, that an unload gives memory back.
Real TorchScript files and sockets; every wait is bounded and on a reply; no test asserts a duration."""
from __future__ import annotations

import hashlib
import itertools
import json
import logging
import subprocess
import sys

import numpy as np
import pytest
import torch
import zmq
from torch import nn

from test_worker_loop import Worker, expect_error
from tgw.shm.errors import Code
from tgw.shm.wire import (IOSpec, LoaderHello, LoadModel, LoadPhase, ModelLoaded, ModelSpec, ModelUnloaded, Stop,
                          UnloadModel, WorkerFailed, WorkerReady, encode, from_worker_decoder)
from tgw.workers import loader as loader_module
from tgw.workers.loader import LOAD_SUFFIX, Loader
from tgw.workers.runner import ModelRunner

WAIT_S = 30.0
IDENTITY = b"w5.0"
WIDTH = 256
AFFINE_BYTES = (WIDTH * WIDTH + WIDTH) * 4      # a Linear(256, 256): weight and bias, float32
CPU = torch.device("cpu")
_endpoints = itertools.count()


class Tied(nn.Module):
    """Two Linear layers sharing one weight, and a buffer: 1 weight, 2 biases, 1 buffer of storage."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.b.weight = self.a.weight
        self.register_buffer("scale", torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)) * self.scale


@pytest.fixture(scope="module")
def affine(tmp_path_factory):
    """(path, sha256, the eager module) of a scripted Linear(256, 256)."""
    torch.manual_seed(10)
    module = nn.Linear(WIDTH, WIDTH).eval()
    path = str(tmp_path_factory.mktemp("loader_models") / "affine.pt")
    torch.jit.script(module).save(path)
    with open(path, "rb") as f:
        return path, hashlib.sha256(f.read()).hexdigest(), module


def spec(path: str, name: str = "affine", out_dtype: str = "float32", out_width: int = WIDTH,
         sha256: str | None = None) -> ModelSpec:
    return ModelSpec(name=name, version="1", path=path, sha256=sha256,
                     inputs=[IOSpec(name="x", dtype="float32", shape=[WIDTH])],
                     outputs=[IOSpec(name="y", dtype=out_dtype, shape=[out_width])])


class LoaderSide:
    """A Loader on a Context shared with a ROUTER that plays the broker's side of it."""

    def __init__(self, startup: list[ModelSpec] | None = None):
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a message to nobody raises, never vanishes
        endpoint = f"inproc://tgw-loader-{next(_endpoints)}"
        self.router.bind(endpoint)
        self.runners: dict[str, ModelRunner] = {}
        self.phases: list[LoadPhase] = []
        self.loader = Loader(self.ctx, endpoint, IDENTITY, 5, self.runners, CPU)
        self.loader.start(startup)

    def recv(self):
        """The loader's next answer; the phases it told on the way are kept in `phases`."""
        while True:
            assert self.router.poll(int(WAIT_S * 1000)), f"no message from the loader within {WAIT_S:.0f}s"
            ident, body = self.router.recv_multipart()
            assert ident == IDENTITY + LOAD_SUFFIX
            msg = from_worker_decoder.decode(body)
            if not isinstance(msg, LoadPhase):
                return msg
            self.phases.append(msg)

    def send(self, frame: bytes) -> None:
        self.router.send_multipart([IDENTITY + LOAD_SUFFIX, frame])

    def ask(self, msg, kind: type, key: str):
        self.send(encode(msg))
        reply = self.recv()
        assert isinstance(reply, kind) and (reply.worker_id, reply.key) == (5, key), reply
        return reply

    def load(self, model: ModelSpec) -> ModelLoaded:
        return self.ask(LoadModel(spec=model), ModelLoaded, f"{model.name}:1")

    def unload(self, key: str) -> ModelUnloaded:
        return self.ask(UnloadModel(key=key), ModelUnloaded, key)

    def refused(self, model: ModelSpec, reason: str) -> str:
        """Load `model`, which must fail for `reason` and leave no runner behind; its error."""
        reply = self.load(model)
        assert reply.reason == reason and reply.error and reply.bytes == 0, reply
        assert reply.rss_before > 0 and reply.rss_after > 0 and self.runners == {}
        return reply.error

    def close(self) -> None:
        assert self.loader.stop(timeout=WAIT_S)
        self.router.close(linger=0)
        self.ctx.term()


@pytest.fixture
def side():
    """A started loader whose first message (read here, kept as .hello) the router got."""
    s = LoaderSide()
    s.hello = s.recv()  # from now on the router can address the loader
    yield s
    s.close()


# ---- loads -------------------------------------------------------------------------------------

def test_hello_comes_first(side):
    assert side.hello == LoaderHello(worker_id=5)


def test_load_measures_the_model_and_publishes_it(side, affine):
    reply = side.load(spec(affine[0], sha256=affine[1]))  # the right digest
    assert reply.error is None and reply.reason == "" and reply.bytes == AFFINE_BYTES
    assert reply.rss_before > 0 and reply.rss_after > 0 and reply.load_ms > 0
    assert side.runners["affine:1"].nbytes == AFFINE_BYTES


def test_a_loaded_model_serves_batches_until_unloaded(side, affine):
    """The serving loop reads the very dict the loader writes: no batch of the model before its
    ModelLoaded, batches right after it, none after its ModelUnloaded."""
    path, _, module = affine
    worker = Worker(side.runners, 64 << 10)
    try:
        x = np.linspace(-1, 1, 2 * WIDTH, dtype=np.float32).reshape(2, WIDTH)
        expect_error(worker, worker.batch(x, "affine"), Code.MODEL_NOT_READY)
        side.load(spec(path))
        worker.batch(x, "affine")
        expected = module(torch.from_numpy(x)).detach().numpy()
        np.testing.assert_allclose(worker.outputs(worker.recv())[0], expected, rtol=1e-5, atol=1e-6)
        side.unload("affine:1")
        expect_error(worker, worker.batch(x, "affine"), Code.MODEL_NOT_READY)
    finally:
        worker.close()


def test_a_repeated_load_answers_with_the_loaded_runner(side, affine):
    first = side.load(spec(affine[0]))
    runner = side.runners["affine:1"]
    again = side.load(spec(affine[0]))
    assert again.error is None and again.bytes == first.bytes == AFFINE_BYTES
    assert side.runners["affine:1"] is runner  # not built again


def test_a_missing_file_fails_naming_it(side, tmp_path):
    path = str(tmp_path / "absent.pt")
    error = side.refused(spec(path), "file")
    assert error.startswith("FileNotFoundError: ") and path in error


def test_a_checksum_mismatch_names_both_digests(side, affine):
    path, actual, _ = affine
    expected = "ab" * 32
    error = side.refused(spec(path, sha256=expected), "checksum")
    assert error.startswith("ChecksumMismatch: ") and path in error and expected in error and actual in error


def test_a_file_that_is_no_model_fails_to_load(side, tmp_path):
    path = tmp_path / "garbage.pt"
    path.write_bytes(b"not a TorchScript archive")
    assert "not a zip archive" in side.refused(spec(str(path)), "format")


@pytest.mark.parametrize("out_dtype, out_width, complaint", [("float64", WIDTH, "is float32, declared float64"),
                                                             ("float32", 128, "has shape [1, 256]")])
def test_a_failed_warm_up_leaves_no_runner(side, affine, out_dtype, out_width, complaint):
    error = side.refused(spec(affine[0], out_dtype=out_dtype, out_width=out_width), "warmup")
    assert error.startswith("OutputMismatch: ") and complaint in error
    assert side.load(spec(affine[0])).error is None  # the key is free for a good declaration


def test_running_out_of_memory_is_its_own_reason(side, affine, monkeypatch):
    def no_memory(spec, device):
        raise MemoryError("cannot allocate the weights")

    monkeypatch.setattr(loader_module, "ModelRunner", no_memory)
    error = side.refused(spec(affine[0]), "out_of_memory")
    assert error.splitlines()[0] == "MemoryError: cannot allocate the weights"   # then the cause and the fix


# ---- unloads, bad messages, stop -----------------------------------------------------------------

def test_unload_drops_the_runner_and_answers_even_when_none_is_loaded(side, affine):
    side.load(spec(affine[0]))
    reply = side.unload("affine:1")
    assert reply.rss_before > 0 and reply.rss_after > 0
    assert side.runners == {}
    side.unload("affine:1")  # not loaded now: answered all the same
    side.unload("nothing:1")


def test_bad_messages_are_logged_and_ignored(side, affine, caplog):
    caplog.set_level(logging.WARNING, logger="tgw.worker")
    side.send(b"\xc1not msgpack")
    side.send(encode(Stop()))  # the serving loop's message: not the loader's to act on
    assert side.load(spec(affine[0])).error is None  # answered: so both were read before it
    warnings = [r.getMessage() for r in caplog.records if r.name == "tgw.worker"]
    assert warnings[0].startswith("undecodable loader message ignored")
    assert warnings[1] == "loader socket got Stop: ignored"


def test_stop_ends_the_thread_and_closes_its_socket(side):
    assert side.loader.stop(timeout=WAIT_S)
    assert not side.loader.thread.is_alive() and side.loader.sock.closed
    assert side.loader.stop()  # again: nothing left to do
    ctx = zmq.Context()
    never = Loader(ctx, "inproc://tgw-loader-never", IDENTITY, 5, {}, CPU)
    assert never.stop() and never.sock.closed  # a loader never started closes too
    ctx.term()


# ---- the runner and the start-up load ----------------------------------------------------------

def test_runner_counts_shared_storage_once(tmp_path):
    path = str(tmp_path / "tied.pt")
    torch.jit.script(Tied()).save(path)
    runner = ModelRunner(spec(path, name="tied"), CPU)
    assert runner.nbytes == (WIDTH * WIDTH + 2 * WIDTH + WIDTH) * 4


def test_start_up_loads_publish_each_model_as_it_is_in(affine):
    """The start-up models load one by one on the loader thread: each told by its phases, then
    published and told (ModelLoaded, startup) at once; WorkerReady names them all after the last."""
    path, sha256, _ = affine
    side = LoaderSide(startup=[spec(path, sha256=sha256), spec(path, name="second")])
    try:
        assert side.recv() == LoaderHello(worker_id=5)
        first = side.recv()
        assert isinstance(first, ModelLoaded) and first.startup and first.key == "affine:1" and first.error is None
        assert first.bytes == AFFINE_BYTES and 0 < first.warm_ms < first.load_ms
        assert [(p.key, p.phase) for p in side.phases] == [("affine:1", "loading"), ("affine:1", "warming")]
        assert side.phases[0].seconds < side.phases[1].seconds
        second = side.recv()
        assert isinstance(second, ModelLoaded) and second.startup and second.key == "second:1"
        ready = side.recv()
        fp = ready.footprints.pop("affine:1")   # measured as it loaded and warmed up (workers/footprint.py)
        assert fp.measured_on == "cpu" and fp.weights >= AFFINE_BYTES and set(fp.by_batch) == {1}
        assert ready == WorkerReady(worker_id=5, models=["affine:1", "second:1"],
                                    sizes={"affine:1": AFFINE_BYTES, "second:1": AFFINE_BYTES},
                                    footprints={"second:1": ready.footprints["second:1"]})
        assert sorted(side.runners) == ["affine:1", "second:1"] and not side.loader.startup_failed
        assert side.load(spec(path)).error is None   # then run-time loads, as ever
    finally:
        side.close()


def test_a_start_up_model_that_fails_fails_the_worker_naming_it(affine):
    path, sha256, _ = affine
    side = LoaderSide(startup=[spec(path, name="good"), spec(path, name="other", sha256="00" * 32),
                               spec(path, name="never")])
    try:
        side.recv()   # its hello
        assert side.recv().key == "good:1"   # served meanwhile: the broker stops the worker on the failure
        bad = side.recv()
        assert isinstance(bad, WorkerFailed) and bad.model == "other:1"
        assert bad.error.startswith("ChecksumMismatch: ") and sha256 in bad.error
        assert list(side.runners) == ["good:1"]   # "never:1" was not tried
        assert side.loader.startup_failed   # the worker's exit status says so once the broker stops it
    finally:
        side.close()


# ---- memory goes back --------------------------------------------------------------------------

BIG = 4096  # a Linear(4096, 4096): 64 MiB of float32 weight

MEMORY = """
import json, sys, torch, zmq
from tgw.shm.wire import IOSpec, LoadModel, ModelSpec, UnloadModel, encode, from_worker_decoder
from tgw.workers.loader import LOAD_SUFFIX, Loader

ctx = zmq.Context()
router = ctx.socket(zmq.ROUTER)
router.bind("inproc://memory")
loader = Loader(ctx, "inproc://memory", b"w", 0, {}, torch.device("cpu"))
loader.start()

def recv():
    while True:   # its answer, past the phases it tells on the way
        assert router.poll(30_000), "the loader did not answer"
        msg = from_worker_decoder.decode(router.recv_multipart()[1])
        if type(msg).__name__ != "LoadPhase":
            return msg

def ask(msg):
    router.send_multipart([b"w" + LOAD_SUFFIX, encode(msg)])
    return recv()

recv()  # its hello
io = [IOSpec(name="x", dtype="float32", shape=[int(sys.argv[2])])]
loaded = ask(LoadModel(spec=ModelSpec(name="big", version="1", path=sys.argv[1], inputs=io, outputs=io)))
assert loaded.error is None, loaded.error
unloaded = ask(UnloadModel(key="big:1"))
assert loader.stop(30)
router.close(0)
ctx.term()
print(json.dumps({"rss_before_load": loaded.rss_before, "rss_after_load": loaded.rss_after,
                  "rss_after_unload": unloaded.rss_after, "bytes": loaded.bytes}))
"""


def test_unload_gives_the_memory_back(tmp_path):
    """In a fresh interpreter, so that no other test's allocations blur the figures."""
    path = str(tmp_path / "big.pt")
    torch.jit.script(nn.Linear(BIG, BIG)).save(path)
    run = subprocess.run([sys.executable, "-W", "ignore", "-c", MEMORY, path, str(BIG)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    rss = json.loads(run.stdout)
    assert rss["bytes"] == (BIG * BIG + BIG) * 4
    before, loaded, unloaded = rss["rss_before_load"], rss["rss_after_load"], rss["rss_after_unload"]
    assert loaded - before > 32 << 20, rss  # the load was real
    assert abs(unloaded - before) <= before // 10, rss
