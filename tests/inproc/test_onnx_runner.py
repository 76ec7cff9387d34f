"""ONNX models in the worker (workers/onnx_program.py): loaded from the worker's private copy by
its loader thread and served by its loop from the ring (inputs bound by pointer, I/O binding);
inputs and outputs bound by name whatever the declared order; every way a declaration differs
from the graph refused at load, by name; weights stored beside the file found from the
model's own folder; an input the graph cannot take answered as the caller's mistake. The
graphs are built with the onnx helpers (tgw.testing.onnx_models), one with torch.onnx.export."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from test_worker_loader import LoaderSide
from test_worker_loop import Worker
from tgw.shm.errors import Code, TgwError
from tgw.shm.wire import IOSpec, LoadModel, ModelLoaded, ModelSpec
from tgw.workers.formats import FormatMismatch, load_in_process
from tgw.workers.runner import ModelRunner

pytest.importorskip("onnxruntime")
from tgw.testing.onnx_models import add_model, two_inputs  # noqa: E402

CPU = torch.device("cpu")


def spec(path: str, inputs, outputs, max_batch_size: int = 8, **kw) -> ModelSpec:
    return ModelSpec(name="m", version="1", path=path, format="onnx", max_batch_size=max_batch_size,
                     warmup_batch_sizes=[1, max_batch_size or 1],
                     inputs=[IOSpec(name=n, dtype=d, shape=s) for n, d, s in inputs],
                     outputs=[IOSpec(name=n, dtype=d, shape=s) for n, d, s in outputs], **kw)


ADD_IO = ([("x", "float32", [4])], [("y", "float32", [4])])


def refusal(s: ModelSpec) -> str:
    with pytest.raises(FormatMismatch) as info:
        ModelRunner(s, CPU)
    return str(info.value)


def test_the_worker_serves_an_onnx_model_from_its_ring(tmp_path):
    path = add_model(str(tmp_path / "add.onnx"), 3, external=True, pad_floats=256)
    side = LoaderSide()
    worker = None
    try:
        side.recv()   # the loader's hello
        reply = side.ask(LoadModel(spec=spec(path, *ADD_IO)), ModelLoaded, "m:1")
        assert reply.error is None, reply.error
        assert reply.bytes == (4 + 256) * 4   # the initializers, external ones too
        assert sorted(reply.footprint.by_batch) == [1, 8] and reply.footprint.weights >= reply.bytes
        worker = Worker(side.runners, 64 << 10)
        for rows in (1, 5, 8):
            x = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)
            worker.batch(x, "m", "1")
            (y,) = worker.outputs(worker.recv())
            assert np.array_equal(y, x + 3)
    finally:
        if worker is not None:
            worker.close()
        side.close()


def test_inputs_and_outputs_are_bound_by_name(tmp_path):
    path = two_inputs(str(tmp_path / "two.onnx"))
    # declared in the other order than the graph's, both ways
    s = spec(path, [("ids", "int64", [-1]), ("scale", "float32", [1])],
             [("count", "int64", []), ("scaled", "float32", [-1])])
    runner = ModelRunner(s, CPU)
    runner.warm_up()
    ids = torch.arange(6).reshape(2, 3)
    count, scaled = runner.run([ids, torch.tensor([[2.0], [0.5]])], 2)
    assert count.tolist() == [3, 3] and scaled.tolist() == [[0, 2, 4], [1.5, 2, 2.5]]
    # in process, without a declaration: the graph's own order
    scaled, count = load_in_process("onnx", path).call(torch.ones(1, 1), torch.arange(4).reshape(1, 4))
    assert count.tolist() == [4] and scaled.tolist() == [[0, 1, 2, 3]]


def test_a_declaration_the_graph_cannot_serve_is_refused_by_name(tmp_path):
    add = add_model(str(tmp_path / "add.onnx"), 1)
    fixed = add_model(str(tmp_path / "fixed.onnx"), 1, batch=4)
    two = two_inputs(str(tmp_path / "two.onnx"))
    said = refusal(spec(fixed, *ADD_IO))
    assert ("input 'x' has a static batch dim of 4 in the model, but the broker batches 1..8 rows (max_batch_size): "
            "export it with a dynamic batch dim: torch.onnx.export(model, args, f, dynamo=True, "
            "dynamic_shapes=({0: torch.export.Dim('batch')},))") in said and said.startswith(f"{fixed} cannot serve m:1")
    assert "has no such input; its inputs are ['x']" in refusal(spec(add, [("image", "float32", [4])], ADD_IO[1]))
    assert "output 'y' is float16 in the config but float32 in the model" in refusal(
        spec(add, ADD_IO[0], [("y", "float16", [4])]))
    assert "input 'x' has 2 dims in the model [batch, 4]; the config declares 2 after the batch dim" in refusal(
        spec(add, [("x", "float32", [2, 2])], ADD_IO[1]))
    assert "input 'x' shape[0] is declared -1 (variable) but is static 4 in the model" in refusal(
        spec(add, [("x", "float32", [-1])], ADD_IO[1]))
    assert "input 'x' shape[0] is declared 5 but is 4 in the model" in refusal(
        spec(add, [("x", "float32", [5])], ADD_IO[1]))
    assert "the model's inputs ['scale'] are not declared" in refusal(
        spec(two, [("ids", "int64", [-1])], [("count", "int64", [])]))
    # max_batch_size 0: the graph has no batch dim; the declared shape is the whole tensor
    assert "(max_batch_size 0: no batch dim)" in refusal(spec(add, *ADD_IO, max_batch_size=0, batched=False))
    ModelRunner(spec(fixed, [("x", "float32", [4, 4])], [("y", "float32", [4, 4])], max_batch_size=0,
                     batched=False), CPU)


def test_inputs_the_graph_cannot_take_are_the_callers_mistake(tmp_path):
    path = two_inputs(str(tmp_path / "two.onnx"))
    s = spec(path, [("ids", "int64", [-1]), ("scale", "float32", [-1])],
             [("count", "int64", []), ("scaled", "float32", [-1])])
    with pytest.raises(FormatMismatch, match=r"input 'scale' shape\[0\] is declared -1 \(variable\) but is static 1"):
        ModelRunner(s, CPU)
    runner = ModelRunner(spec(path, [("ids", "int64", [-1]), ("scale", "float32", [1])],
                              [("count", "int64", []), ("scaled", "float32", [-1])]), CPU)
    with pytest.raises(TgwError) as info:   # scale's rows do not broadcast against ids'
        runner.run([torch.zeros(2, 3, dtype=torch.int64), torch.zeros(3, 1)], 2)
    assert info.value.code is Code.INVALID_ARGUMENT and "model m:1 rejected its inputs (ids [2, 3], scale [3, 1])" \
        in str(info.value)


def test_a_torch_export_with_external_weights_loads_from_its_folder(tmp_path):
    """torch.onnx.export (dynamo) writes large weights beside the file by default."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 4)).eval()
    path = str(tmp_path / "mlp.onnx")
    torch.onnx.export(model, (torch.randn(2, 256),), path, dynamo=True, input_names=["x"], output_names=["y"],
                      dynamic_shapes=({0: torch.export.Dim("batch")},))
    assert (tmp_path / "mlp.onnx.data").stat().st_size > 256 * 512 * 4
    runner = ModelRunner(spec(path, [("x", "float32", [256])], [("y", "float32", [4])]), CPU)
    assert runner.nbytes == sum(p.numel() * 4 for p in model.parameters())
    x = torch.randn(3, 256)
    with torch.inference_mode():
        assert torch.allclose(runner.run([x], 3)[0], model(x), atol=1e-5)
