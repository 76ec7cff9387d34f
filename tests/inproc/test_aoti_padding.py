"""An AOTInductor package whose smallest batch is above 1 row is served all the same.

Built as README's Models recipe says (save_model: exported with Dim("batch", min=1, max=32),
saved, loaded back, compiled with mkldnn and nnpack off), this two-output model still refuses a
batch of 1: torch specialises sizes 0 and 1, so the package takes 2..32 rows. The worker finds
that minimum at load, pads smaller batches up to it and drops the padding rows from every
output; a package that cannot serve max_batch_size, or whose minimum lies above it, is still
refused. Loaded by the worker's loader thread and served by its loop (tests/inproc/test_worker_loader.py's
and test_worker_loop.py's harnesses). Compiling takes tens of seconds: once per module.
"""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch import nn
from torch.export import Dim

from test_worker_loader import LoaderSide
from test_worker_loop import Worker
from tgw.shm.wire import IOSpec, LoadModel, ModelLoaded, ModelSpec
from tgw.workers.demo_models import cxx_compiler, save_model
from tgw.workers.formats import FormatMismatch, load_in_process
from tgw.workers.runner import ModelRunner

WIDTH, MAX_BATCH = 16, 32
CPU = torch.device("cpu")


class TwoOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(WIDTH, 32), nn.Tanh(), nn.Linear(32, 8))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.net(x), x.sum(dim=1)


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> str:
    if cxx_compiler() is None:
        pytest.skip("AOTInductor needs a C++ compiler ($CXX, c++, g++ or clang++): none found")
    torch.manual_seed(7)
    path = str(tmp_path_factory.mktemp("aoti_padding") / "two-aoti.pt2")
    try:
        save_model(TwoOutputs().eval(), (torch.randn(4, WIDTH),), path, "aoti",
                   ({0: Dim("batch", min=1, max=MAX_BATCH)},))
    except (ImportError, OSError, torch._inductor.exc.CppCompileError, torch._inductor.exc.InductorError) as exc:
        pytest.skip(f"torch cannot compile an AOTInductor package here: {type(exc).__name__}: {exc}"[:300])
    return path


def spec(path: str, max_batch_size: int = MAX_BATCH, warmup=(1,)) -> ModelSpec:
    return ModelSpec(name="two", version="3", path=path, format="aoti", max_batch_size=max_batch_size,
                     warmup_batch_sizes=list(warmup),
                     inputs=[IOSpec(name="x", dtype="float32", shape=[WIDTH])],
                     outputs=[IOSpec(name="y", dtype="float32", shape=[8]), IOSpec(name="total", dtype="float32",
                                                                                   shape=[])])


def in_process(path: str, x: np.ndarray) -> list[np.ndarray]:
    """What the package computes for x in this process; a single row runs as two equal rows."""
    program = load_in_process("aoti", path).call
    rows = x if len(x) > 1 else np.concatenate([x, x])
    with torch.inference_mode():
        return [t[:len(x)].numpy() for t in program(torch.from_numpy(rows))]


def test_the_recipes_package_refuses_a_batch_of_one_in_process(package):
    program = load_in_process("aoti", package).call
    with pytest.raises(RuntimeError, match="dim value is too small at 0, expected it to be >= 2"):
        program(torch.zeros(1, WIDTH))


def test_the_worker_loads_it_pads_short_batches_and_drops_the_padding(package, caplog):
    caplog.set_level(logging.INFO, logger="tgw.worker")
    side = LoaderSide()
    worker = None
    try:
        side.recv()   # the loader's hello
        reply = side.ask(LoadModel(spec=spec(package)), ModelLoaded, "two:3")
        assert reply.error is None, reply.error
        said = [r.getMessage() for r in caplog.records if r.name == "tgw.worker" and "padded" in r.getMessage()]
        assert said == ["model two version 3: the AOTInductor package takes batches of 2 rows or more; smaller "
                        "batches are padded to 2 rows, the padding dropped from the outputs"]
        worker = Worker(side.runners, 64 << 10)
        rng = np.random.default_rng(3)
        for rows in (1, 3, 1):
            x = rng.standard_normal((rows, WIDTH), dtype=np.float32)
            worker.batch(x, "two", "3")
            done = worker.recv()
            assert done.error is None, done.error
            assert [t.shape for t in done.outputs] == [[rows, 8], [rows]]
            y, total = worker.outputs(done)
            want_y, want_total = in_process(package, x)
            assert torch.allclose(torch.from_numpy(y), torch.from_numpy(want_y), rtol=1e-5, atol=1e-6)
            assert torch.allclose(torch.from_numpy(total), torch.from_numpy(want_total), rtol=1e-5, atol=1e-6)
    finally:
        if worker is not None:
            worker.close()
        side.close()


def test_a_package_whose_minimum_lies_above_max_batch_size_is_refused(package):
    with pytest.raises(FormatMismatch) as info:
        ModelRunner(spec(package, max_batch_size=1), CPU).warm_up()
    assert ("input 'x' batch dim: the AOTInductor package takes batches of 2 rows or more (input_handles[0]: dim "
            "value is too small at 0, expected it to be >= 2, but got: 1), more than max_batch_size 1") \
        in str(info.value)


def test_a_package_that_cannot_take_max_batch_size_is_still_refused(package):
    with pytest.raises(FormatMismatch) as info:
        ModelRunner(spec(package, max_batch_size=MAX_BATCH + 8), CPU).warm_up()
    message = str(info.value)
    assert f"a batch of {MAX_BATCH + 8} rows is refused by the AOTInductor package" in message
    assert f"expected to be <= {MAX_BATCH}" in message
