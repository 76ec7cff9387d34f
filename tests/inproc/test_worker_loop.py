"""The worker's serving loop (workers/serve.py) in-process: Server.serve() in a thread on a DEALER,
driven from a ROUTER over inproc:// as the broker drives it, with real TorchScript models and a
real segment. Model errors, unknown models, passed deadlines, a full output arena, bad releases.

Every wait is bounded and waits on something observable (a reply, the thread's end); no test
relies on timing to prove that something did not happen."""
from __future__ import annotations

import itertools
import logging
import os
import threading
import time

import numpy as np
import pytest
import torch
import zmq

import worker_ext
from models import MODELS, save
from tgw.shm.errors import Code
from tgw.shm.ring import aligned_total
from tgw.shm.segment import Segment, new_name
from tgw.shm.views import block_view
from tgw.shm.wire import (PROTOCOL_VERSION, Batch, BlockTensor, Done, IOSpec, ModelSpec, Release, Stop,
                          WorkerHello, encode, from_worker_decoder)
from tgw.workers.device_io import DeviceIO
from tgw.workers.runner import ModelRunner
from tgw.workers.serve import Server

IN_BYTES = 64 << 10
ONE_BATCH = 4096                 # an output arena that holds one [1, 1024] float32 output
WAIT_S = 10.0                    # bound on every wait for a reply or for the thread to end
IDENTITY = b"w0.0"
_endpoints = itertools.count()


def load_runners(d, device: torch.device) -> dict[str, ModelRunner]:
    """"double:1" (y = 2x, any width), "fails:1" (y = x + 1, raises on a negative x[0, 0]) and
    "gpu_hungry:1" (y = 2x, out of GPU memory past 4 rows: tests/worker_ext.py)."""
    out = {}
    for name, (saver, decl) in {"double": (save, MODELS["double"][1]), "fails": (save, MODELS["fails"][1]),
                                "gpu_hungry": (worker_ext.save, worker_ext.IO)}.items():
        path = str(d / f"{name}.pt")
        saver(name, path)
        io = {k: [IOSpec(**t) for t in decl[k]] for k in ("inputs", "outputs")}
        runner = ModelRunner(ModelSpec(name=name, version="1", path=path, **io), device)
        out[runner.key] = runner
    return out


@pytest.fixture(scope="module")
def runners(tmp_path_factory) -> dict[str, ModelRunner]:
    return load_runners(tmp_path_factory.mktemp("worker_models"), torch.device("cpu"))


class Worker:
    """A Server serving in a thread; this side plays the broker: it writes inputs into the input
    arena, sends Batch/Release/Stop on a ROUTER and reads Done messages back."""

    def __init__(self, runners: dict[str, ModelRunner], output_bytes: int, serving: bool = True, **server):
        self.segment = Segment.create(new_name("ring"), IN_BYTES + output_bytes)
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.server = Server(self.dealer, self.segment, IN_BYTES, output_bytes, runners, **server)
        self.thread = threading.Thread(target=self._serve, name="tgw-test-worker", daemon=True)
        self.error: BaseException | None = None
        self.returned = False
        self.next_in, self.batch_ids = 0, itertools.count(1)
        try:
            self._connect(f"inproc://tgw-worker-{next(_endpoints)}")
        except BaseException:
            self.close()
            raise
        if serving:
            self.thread.start()

    def start_serving(self) -> None:
        """Start serve() (a Worker made with serving=False): what was sent before is all queued."""
        self.thread.start()

    def _connect(self, endpoint: str) -> None:
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)   # a message to nobody raises, never vanishes
        self.router.bind(endpoint)
        self.dealer.setsockopt(zmq.IDENTITY, IDENTITY)
        self.dealer.connect(endpoint)
        # the worker's hello, as in workers/main.py: once read, the router can address the worker
        self.dealer.send(encode(WorkerHello(v=PROTOCOL_VERSION, worker_id=0, pid=os.getpid())))
        assert self.router.poll(int(WAIT_S * 1000)), "the hello never reached the router"
        self.router.recv_multipart()

    def _serve(self) -> None:
        try:
            self.server.serve()
            self.returned = True
        except BaseException as exc:  # reported by recv()/stop() in the test's thread
            self.error = exc

    def send(self, msg) -> None:
        self.router.send_multipart([IDENTITY, encode(msg)])

    def batch(self, x: np.ndarray, model: str = "double", version: str = "1", **fields) -> Batch:
        """Write x into a fresh input block and send a batch of it; returns what was sent."""
        block = self.next_in
        self.next_in += aligned_total([x.nbytes])
        assert self.next_in <= IN_BYTES, "test bug: input arena exhausted"
        self.segment.buf[block:block + x.nbytes] = x.tobytes()
        msg = Batch(batch_id=next(self.batch_ids), model=model, version=version, rows=len(x), block=block,
                    inputs=[BlockTensor(name="x", dtype=x.dtype.name, shape=list(x.shape), offset=block,
                                        nbytes=x.nbytes)], **fields)
        self.send(msg)
        return msg

    def recv(self) -> Done:
        deadline = time.monotonic() + WAIT_S
        while not self.router.poll(100):
            # a thread seen dead may have sent its last reply just after that poll
            assert self.thread.is_alive() or self.router.poll(0), f"serve() ended: {self.error!r}"
            assert time.monotonic() < deadline, f"no reply from the worker in {WAIT_S:.0f} s"
        ident, payload = self.router.recv_multipart()
        msg = from_worker_decoder.decode(payload)
        assert ident == IDENTITY and isinstance(msg, Done), msg
        return msg

    def outputs(self, done: Done) -> list[np.ndarray]:
        assert done.error is None, done.error
        return [block_view(self.segment.buf, t).copy() for t in done.outputs]

    def stop(self) -> None:
        self.send(Stop())
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive(), "serve() did not return after Stop"
        assert self.returned and self.error is None, self.error

    def close(self) -> None:
        try:
            if self.thread.is_alive():
                self.stop()
        finally:
            self.router.close(linger=0)
            if not self.thread.is_alive():   # a hung thread keeps its socket, the context and the mapping
                self.dealer.close(linger=0)
                self.ctx.term()
                self.segment.close()
            self.segment.unlink()


@pytest.fixture
def start(runners):
    """start(output_bytes=64 KiB, with_runners=None, serving=True, **Server arguments) -> a Worker;
    each is stopped and cleaned up at teardown."""
    workers: list[Worker] = []

    def factory(output_bytes: int = 64 << 10, with_runners: dict | None = None, **kw) -> Worker:
        w = Worker(with_runners or runners, output_bytes, **kw)
        workers.append(w)
        return w

    yield factory
    for w in workers:
        w.close()


def rows(n: int, width: int = 2, first: float = 1.0) -> np.ndarray:
    return np.arange(n * width, dtype=np.float32).reshape(n, width) + first


def full(seed: float) -> np.ndarray:
    """Input of "double" whose output fills a ONE_BATCH arena exactly."""
    return rows(1, ONE_BATCH // 4, seed)


def expect_error(w: Worker, batch: Batch, code: Code) -> Done:
    """The next reply fails `batch` with `code`, carrying no outputs."""
    done = w.recv()
    assert done.batch_id == batch.batch_id
    assert done.error is not None and done.error.code == code.value, done.error
    assert done.outputs == [] and done.block is None
    return done


def expect_doubled(w: Worker, batch: Batch, x: np.ndarray, block: int) -> Done:
    """The next reply answers `batch` (of "double" on x) with 2x in output block `block`."""
    done = w.recv()
    assert done.batch_id == batch.batch_id and done.block == block
    (y,) = w.outputs(done)
    np.testing.assert_array_equal(y, 2 * x)
    return done


def ignored_releases(caplog) -> list[int]:
    """The blocks the worker logged as bad releases."""
    return [r.args[0] for r in caplog.records if r.name == "tgw.worker" and r.levelno == logging.WARNING
            and getattr(r, "event", None) != "batch_failed"]   # failed batches have lines of their own


# ---- running batches ---------------------------------------------------------------------------

def test_batch_output_lands_in_the_output_arena(start):
    w = start()
    x = rows(3, 5)
    (y,) = expect_doubled(w, w.batch(x), x, block=0).outputs
    assert (y.name, y.dtype, y.shape, y.offset, y.nbytes) == ("y", "float32", [3, 5], IN_BYTES, x.nbytes)
    x2 = rows(1, 7, -4.0)
    expect_doubled(w, w.batch(x2), x2, block=aligned_total([x.nbytes]))  # block 0 is still lent


def test_model_exception_fails_that_batch_only(start):
    w = start()
    bad = w.batch(np.array([[-1.0, 2.0]], dtype=np.float32), "fails")
    done = expect_error(w, bad, Code.MODEL_EXECUTION_ERROR)
    assert "negative input rejected" in done.error.message
    x = rows(2)
    good = w.batch(x, "fails")
    done = w.recv()
    assert done.batch_id == good.batch_id
    np.testing.assert_array_equal(w.outputs(done)[0], x + 1)


@pytest.mark.parametrize("model, version", [("nope", "1"), ("double", "2")])
def test_model_not_loaded(start, model, version):
    w = start()
    expect_error(w, w.batch(rows(1), model, version), Code.MODEL_NOT_READY)
    x = rows(2)
    expect_doubled(w, w.batch(x), x, block=0)


def test_passed_deadline_skips_the_model(start):
    w = start()
    past = time.monotonic() - 1.0
    # had the model run, this input would have failed it: MODEL_EXECUTION_ERROR
    b = w.batch(np.array([[-1.0, 0.0]], dtype=np.float32), "fails", deadline=past)
    expect_error(w, b, Code.DEADLINE_EXCEEDED)
    expect_error(w, w.batch(rows(4), deadline=past), Code.DEADLINE_EXCEEDED)
    x = rows(2)
    b = w.batch(x, deadline=time.monotonic() + 3600)
    expect_doubled(w, b, x, block=0)              # the skipped batches took no output space


# ---- output arena space ------------------------------------------------------------------------

def test_full_output_arena_waits_for_a_release(start):
    w = start(ONE_BATCH)
    x1, x2 = full(1.0), full(-7.0)
    expect_doubled(w, w.batch(x1), x1, block=0)
    b2 = w.batch(x2)                 # no room until block 0 is released
    w.send(Release(blocks=[0]))
    # batch 2 can only have got space from that release, sent after it
    expect_doubled(w, b2, x2, block=0)


def test_release_on_a_batch_that_arrives_while_waiting(start, caplog):
    caplog.set_level(logging.WARNING, logger="tgw.worker")
    w = start(ONE_BATCH)
    x1, x2, x4 = full(1.0), full(2.0), full(3.0)
    expect_doubled(w, w.batch(x1), x1, block=0)
    b2 = w.batch(x2)                                 # waits for space
    b3 = w.batch(rows(1), "nope", release=[0])       # frees it; is served after batch 2
    expect_doubled(w, b2, x2, block=0)
    expect_error(w, b3, Code.MODEL_NOT_READY)
    w.send(Release(blocks=[0]))
    expect_doubled(w, w.batch(x4), x4, block=0)
    assert ignored_releases(caplog) == []            # batch 3's release was applied once, not again


def test_output_larger_than_the_arena(start):
    w = start(ONE_BATCH)
    done = expect_error(w, w.batch(rows(1, ONE_BATCH // 4 + 16)), Code.OUT_OF_SHM)
    assert done.error.details["arena"] == "output"
    x = full(5.0)
    expect_doubled(w, w.batch(x), x, block=0)


def expect_part(w: Worker, batch: Batch, first: int, count: int, final: bool) -> Done:
    """The next reply is the part of `batch` answering requests first..first+count-1."""
    done = w.recv()
    assert (done.batch_id, done.first, done.count, done.final) == (batch.batch_id, first, count, final)
    return done


def test_outputs_too_large_for_the_arena_come_in_parts(start):
    w = start(ONE_BATCH)
    x = rows(5, ONE_BATCH // 4 // 4)                     # a row's output is a quarter of the arena
    b = w.batch(x, splits=[2, 1, 2])                     # three requests: 5 rows do not fit at once
    p0 = expect_part(w, b, 0, 2, final=False)            # rows 0-2 fit; request 2's would not
    assert p0.block == 0 and p0.error is None
    np.testing.assert_array_equal(w.outputs(p0)[0], 2 * x[:3])
    w.send(Release(blocks=[0]))                          # the arena is full until then
    p1 = expect_part(w, b, 2, 1, final=True)
    assert p1.block == 0                                 # its space can only have come from that release
    np.testing.assert_array_equal(w.outputs(p1)[0], 2 * x[3:])
    w.send(Release(blocks=[0]))
    y = rows(2, 8)                                       # a batch that fits: one completion, as before
    done = expect_doubled(w, w.batch(y, splits=[1, 1]), y, block=0)
    assert (done.first, done.count, done.final) == (0, 0, True)


def test_request_too_large_alone_fails_alone(start):
    w = start(ONE_BATCH)
    width = ONE_BATCH // 4 // 2                          # a row's output is half the arena
    x = rows(5, width)
    b = w.batch(x, splits=[1, 3, 1])                     # the middle request can never fit
    p0 = expect_part(w, b, 0, 1, final=False)
    np.testing.assert_array_equal(w.outputs(p0)[0], 2 * x[:1])
    err = expect_part(w, b, 1, 1, final=False)
    assert err.error.code == Code.OUT_OF_SHM.value and err.outputs == [] and err.block is None
    need = aligned_total([3 * width * 4])
    assert f"{need} bytes" in err.error.message and str(ONE_BATCH) in err.error.message
    assert "workers.output_arena_mb" in err.error.message
    assert err.error.details == {"arena": "output", "needed": need, "limit": ONE_BATCH,
                                 "config_key": "workers.output_arena_mb"}
    p2 = expect_part(w, b, 2, 1, final=True)             # fits beside part 0: no release needed
    assert p2.block == aligned_total([width * 4])
    np.testing.assert_array_equal(w.outputs(p2)[0], 2 * x[4:])


def test_bad_releases_are_logged_and_ignored(start, caplog):
    caplog.set_level(logging.WARNING, logger="tgw.worker")
    w = start(ONE_BATCH)
    x1, x2, x3, x4 = full(1.0), full(2.0), full(3.0), full(4.0)
    expect_doubled(w, w.batch(x1), x1, block=0)
    w.send(Release(blocks=[0]))
    w.send(Release(blocks=[0, 640]))                 # released already; never lent
    expect_doubled(w, w.batch(x2), x2, block=0)
    b3 = w.batch(x3)                                 # waits for space
    w.send(Release(blocks=[192, 0]))                 # read while waiting: the bad block does not stop the good one
    expect_doubled(w, b3, x3, block=0)
    expect_doubled(w, w.batch(x4, release=[704, 0]), x4, block=0)   # the same on a batch
    assert ignored_releases(caplog) == [0, 640, 192, 704]


def test_stop_ends_serve_after_the_work_before_it(start):
    w = start()
    x = rows(2)
    b = w.batch(x)
    w.stop()
    expect_doubled(w, b, x, block=0)


# ---- batches in flight together, out of GPU memory ---------------------------------------------

def test_batches_queued_together_are_launched_before_the_oldest_is_answered(start):
    """With overlap (a CUDA worker's way: the next batch's copy overlaps this one's compute), a
    batch waiting is launched before the oldest is answered; answers keep their order. When the
    arena is full, the batches launched are answered first so the broker can free their blocks."""
    w = start(ONE_BATCH, serving=False, overlap=True)
    x1, x2, x3 = full(1.0), full(2.0), full(3.0)
    b1, b2, b3 = w.batch(x1), w.batch(x2), w.batch(x3)
    w.start_serving()
    expect_doubled(w, b1, x1, block=0)        # b2 found the arena full: b1 was answered first
    w.send(Release(blocks=[0]))
    expect_doubled(w, b2, x2, block=0)
    w.send(Release(blocks=[0]))
    expect_doubled(w, b3, x3, block=0)
    y1, y2 = rows(2), rows(3, 2, 9.0)
    w.send(Release(blocks=[0]))
    w2 = start(serving=False, overlap=True)
    c1, c2 = w2.batch(y1), w2.batch(y2)
    w2.start_serving()
    expect_doubled(w2, c1, y1, block=0)
    expect_doubled(w2, c2, y2, block=aligned_total([y1.nbytes]))   # both held blocks at once


def test_out_of_gpu_memory_runs_the_batch_again_in_halves(start):
    w = start()
    x = rows(8, 1)
    b = w.batch(x, "gpu_hungry", splits=[1] * 8)          # 8 rows: more than the op holds (4)
    p0 = expect_part(w, b, 0, 4, final=False)
    p1 = expect_part(w, b, 4, 4, final=True)
    np.testing.assert_array_equal(np.concatenate([w.outputs(p0)[0], w.outputs(p1)[0]]), 2 * x)
    assert w.server.progress.gpu_ooms == 1


def test_a_request_that_does_not_fit_alone_is_answered_out_of_gpu_memory(start):
    w = start()
    x = rows(7, 1)
    b = w.batch(x, "gpu_hungry", splits=[1, 5, 1])       # the middle request alone is 5 rows
    p0 = expect_part(w, b, 0, 1, final=False)
    np.testing.assert_array_equal(w.outputs(p0)[0], 2 * x[:1])
    err = expect_part(w, b, 1, 1, final=False)
    assert err.error.code == Code.OUT_OF_GPU_MEMORY.value and err.outputs == []
    assert err.error.message.startswith("CUDA out of memory. Tried to allocate 5 rows")   # not the traceback
    p2 = expect_part(w, b, 2, 1, final=True)
    np.testing.assert_array_equal(w.outputs(p2)[0], 2 * x[6:])
    assert w.server.progress.gpu_ooms == 3                # 7 rows, then 6 (requests 1-2), then 5 alone
    y = rows(3, 1)
    b2 = w.batch(y, "gpu_hungry", splits=[3])              # the worker serves on: one whole answer
    done = w.recv()
    assert (done.batch_id, done.first, done.count, done.final) == (b2.batch_id, 0, 0, True)
    np.testing.assert_array_equal(w.outputs(done)[0], 2 * y)
    alone = w.batch(rows(6, 1), "gpu_hungry", splits=[6])  # one request: tried again once, then answered
    expect_error(w, alone, Code.OUT_OF_GPU_MEMORY)
    assert w.server.progress.gpu_ooms == 5


def test_host_memory_is_the_mode_in_effect(runners, monkeypatch):
    """What a hello can carry: "" on the CPU; on a GPU the mode in use, staging once the ring's
    registration failed (device_io.py falls back). The registration is stood in for: no GPU here."""
    monkeypatch.setattr(DeviceIO, "_register", lambda io: False)
    segment = Segment.create(new_name("ring"), IN_BYTES + ONE_BATCH)
    try:
        assert Server(None, segment, IN_BYTES, ONE_BATCH, runners).host_memory == ""
        gpu = Server(None, segment, IN_BYTES, ONE_BATCH, runners, device=torch.device("cuda", 0))
        assert (gpu.io.mode, gpu.host_memory) == ("staging", "staging")
        del gpu
    finally:
        try:
            segment.close()
        except BufferError:   # the stand-in's ring still views the mapping; it goes with the process
            pass
        segment.unlink()


# ---- on a GPU (skipped without CUDA) ------------------------------------------------------------

def needs_cuda(test):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")(test))


@pytest.fixture(scope="module")
def cuda_runners(tmp_path_factory) -> dict[str, ModelRunner]:
    return load_runners(tmp_path_factory.mktemp("cuda_models"), torch.device("cuda:0"))


@needs_cuda
@pytest.mark.parametrize("host_memory", ["register", "staging", "pageable"])
def test_cuda_worker_copies_each_way_and_overlaps_batches(start, cuda_runners, host_memory):
    w = start(with_runners=cuda_runners, serving=False, device=torch.device("cuda:0"), host_memory=host_memory)
    assert w.server.io.mode == host_memory or (host_memory == "register" and w.server.io.mode == "staging")
    assert w.server.host_memory == w.server.io.mode
    xs = [rows(n, 33, float(n)) for n in (1, 5, 3)]        # 132-byte rows: offsets only 64-byte aligned
    sent = [w.batch(x) for x in xs]
    w.start_serving()
    block = 0
    for b, x in zip(sent, xs):
        expect_doubled(w, b, x, block=block)
        block += aligned_total([x.nbytes])
    b = w.batch(np.array([[-1.0, 0.0]], dtype=np.float32), "fails")   # a model error on the GPU path
    expect_error(w, b, Code.MODEL_EXECUTION_ERROR)


@needs_cuda
def test_cuda_out_of_memory_is_split_and_the_worker_serves_on(start, tmp_path):
    """A real CUDA out-of-memory in a TorchScript forward (a RuntimeError there, not
    OutOfMemoryError): each row takes 30% of the GPU, so 4 rows cannot fit, 2 can."""
    free, total = torch.cuda.mem_get_info(0)
    if free < 0.7 * total:
        pytest.skip(f"the GPU is busy: {free >> 20} MiB free of {total >> 20}")

    class Allocates(torch.nn.Module):
        def __init__(self, per_row: int):
            super().__init__()
            self.per_row = per_row

        def forward(self, x):
            buf = torch.empty([x.shape[0] * self.per_row], dtype=torch.uint8, device=x.device)
            return x * 2 + buf[:1].to(x.dtype) * 0

    path = str(tmp_path / "allocates.pt")
    torch.jit.script(Allocates(int(0.3 * total))).save(path)
    io = {k: [IOSpec(**t) for t in worker_ext.IO[k]] for k in ("inputs", "outputs")}
    runner = ModelRunner(ModelSpec(name="allocates", version="1", path=path, **io), torch.device("cuda:0"))
    w = start(with_runners={runner.key: runner}, device=torch.device("cuda:0"))
    x = rows(4, 1)
    b = w.batch(x, "allocates", splits=[1, 1, 1, 1])
    p0, p1 = expect_part(w, b, 0, 2, final=False), expect_part(w, b, 2, 2, final=True)
    np.testing.assert_array_equal(np.concatenate([w.outputs(p0)[0], w.outputs(p1)[0]]), 2 * x)
    alone = w.batch(rows(4, 1), "allocates", splits=[4])
    done = expect_error(w, alone, Code.OUT_OF_GPU_MEMORY)
    assert done.error.message.startswith("CUDA out of memory")
    y = rows(1, 1)
    served = w.batch(y, "allocates")
    done = w.recv()
    assert done.batch_id == served.batch_id
    np.testing.assert_array_equal(w.outputs(done)[0], 2 * y)
    assert w.server.progress.gpu_ooms == 3   # the batch, then the request alone twice
