"""ONNX models on a CUDA worker (workers/onnx_program.py): the CUDA execution provider on the
worker's device, inputs bound by pointer to the batch's device buffer, outputs handed to torch
on the device by DLPack; and, where onnxruntime has no CUDA provider (the CPU wheel), the load
refused saying so. Skipped cleanly without a CUDA device."""
from __future__ import annotations

import pytest
import torch

from tgw.shm.wire import IOSpec, ModelSpec
from tgw.workers.onnx_program import CUDA_EP, OnnxUnavailable
from tgw.workers.runner import ModelRunner

ort = pytest.importorskip("onnxruntime")
from tgw.testing.onnx_models import add_model  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")]
CUDA = torch.device("cuda:0")


def spec(path: str) -> ModelSpec:
    return ModelSpec(name="m", version="1", path=path, format="onnx", max_batch_size=8, warmup_batch_sizes=[1, 8],
                     inputs=[IOSpec(name="x", dtype="float32", shape=[4])],
                     outputs=[IOSpec(name="y", dtype="float32", shape=[4])])


def test_an_onnx_model_runs_on_the_cuda_provider_or_is_refused(tmp_path):
    path = add_model(str(tmp_path / "add.onnx"), 5)
    if CUDA_EP not in ort.get_available_providers():
        with pytest.raises(OnnxUnavailable, match="install onnxruntime-gpu in place of onnxruntime"):
            ModelRunner(spec(path), CUDA)
        return
    runner = ModelRunner(spec(path), CUDA)
    runner.warm_up()
    x = torch.arange(12, dtype=torch.float32, device=CUDA).reshape(3, 4)
    (y,) = runner.forward([x], 3)
    assert y.device == CUDA and torch.equal(y.cpu(), x.cpu() + 5)
    assert runner.run([x], 3)[0].device.type == "cpu"
