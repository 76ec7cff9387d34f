"""A Triton model repository served as it is: one broker started with `--model-repository` (no
model in its YAML) over a repository holding each platform: a pytorch_libtorch model (docs/
MIGRATING.md's config.pbtxt, INPUT__N declared out of order, a version folder the policy leaves
out holding no model), python_backend's add_sub verbatim (max_batch_size 0), a batched Python
model, an onnxruntime_onnx model (when onnxruntime is installed) and an ensemble of the Python
model and the TorchScript one, its steps listed out of order. Driven with tritonclient over HTTP."""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile

import numpy as np
import pytest
import torch
import tritonclient.http as httpclient

import triton_py_models as py_models
from conftest import readme_block
from tgw.client import Client
from tgw.testing.child import BrokerProc

HAS_ONNX = importlib.util.find_spec("onnxruntime") is not None and importlib.util.find_spec("onnx") is not None

DOUBLE = '''\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", (x * 2).astype(np.float32))]))
        return out
'''
DOUBLE_CONFIG = '''backend: "python"
max_batch_size: 8
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
'''
PLUS_CONFIG = '''platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] } ]
'''
CHAIN_CONFIG = '''platform: "ensemble"
max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [
  { model_name: "scale" model_version: -1 input_map { key: "INPUT__0" value: "doubled" }
    input_map { key: "INPUT__1" value: "X" } output_map { key: "OUTPUT__0" value: "Y" } },
  { model_name: "double" model_version: -1 input_map { key: "IN" value: "X" } output_map { key: "OUT" value: "doubled" } }
] }
'''


class Scale(torch.nn.Module):
    """Triton's PyTorch backend convention: INPUT__0 is the first argument, OUTPUT__N the N-th item."""

    def __init__(self, k: float):
        super().__init__()
        self.k = k

    def forward(self, a: torch.Tensor, b: torch.Tensor):
        return a * self.k - b, a + b


def write(path: str, text: str | bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb" if isinstance(text, bytes) else "w") as f:
        f.write(text)


def repository(root: str) -> None:
    write(f"{root}/scale/config.pbtxt", readme_block("triton-repository-example:scale"))
    for version, k in (("1", 1.0), ("2", 3.0)):
        os.makedirs(f"{root}/scale/{version}")
        torch.jit.save(torch.jit.script(Scale(k)), f"{root}/scale/{version}/model.pt")
    write(f"{root}/scale/7/model.pt", b"not a model: version_policy leaves folder 7 out")
    write(f"{root}/add_sub/config.pbtxt", py_models.ADD_SUB_CONFIG)
    write(f"{root}/add_sub/1/model.py", py_models.ADD_SUB)
    write(f"{root}/double/config.pbtxt", DOUBLE_CONFIG)
    write(f"{root}/double/1/model.py", DOUBLE)
    write(f"{root}/chain/config.pbtxt", CHAIN_CONFIG)
    os.makedirs(f"{root}/chain/1")
    if HAS_ONNX:
        from tgw.testing.onnx_models import add_model
        write(f"{root}/plus/config.pbtxt", PLUS_CONFIG)
        os.makedirs(f"{root}/plus/1")
        add_model(f"{root}/plus/1/model.onnx", 5.0)


@pytest.fixture(scope="module")
def broker():
    d = os.path.realpath(tempfile.mkdtemp(prefix="tgwtr-", dir="/tmp"))   # ipc paths must stay short
    repository(os.path.join(d, "repo"))
    cfg = {"http": {"port": 0}, "workers": {"devices": ["cpu"], "threads_per_worker": 1, "input_arena_mb": 4,
                                            "output_arena_mb": 2}}
    b = BrokerProc(cfg, d).start(args=("--model-repository", os.path.join(d, "repo")))
    with Client(b.address) as c:
        b.http = c.status()["http"]
    yield b
    code = b.stop()
    shutil.rmtree(d, ignore_errors=True)
    assert code == 0, f"broker exited {code} on SIGTERM:\n{b.output()}"


def test_a_repository_of_each_platform_serves_unchanged(broker):
    c = httpclient.InferenceServerClient(broker.http.removeprefix("http://"))
    try:
        index = {(m["name"], m.get("version")) for m in c.get_model_repository_index()}
        want = {("scale", "1"), ("scale", "2"), ("add_sub", "1"), ("double", "1"), ("chain", "1")}
        assert want | ({("plus", "1")} if HAS_ONNX else set()) == index

        def tensor(name, x, datatype="FP32"):
            t = httpclient.InferInput(name, list(x.shape), datatype)
            t.set_data_from_numpy(x)
            return t

        a = np.arange(8, dtype=np.float32).reshape(2, 4)
        b = np.full((2, 4), 0.5, np.float32)
        for version, k in (("", 3.0), ("1", 1.0)):   # no version: the highest the policy chose
            r = c.infer("scale", [tensor("INPUT__0", a), tensor("INPUT__1", b)], model_version=version)
            np.testing.assert_allclose(r.as_numpy("OUTPUT__0"), a * k - b)   # by position, not declared order
            np.testing.assert_allclose(r.as_numpy("OUTPUT__1"), a + b)
        assert c.get_model_config("scale")["max_batch_size"] == 8
        x, y = np.random.default_rng(0).random((2, 4), dtype=np.float32)
        r = c.infer("add_sub", [tensor("INPUT0", x), tensor("INPUT1", y)])   # max_batch_size 0: no batch dim
        np.testing.assert_allclose(r.as_numpy("OUTPUT0"), x + y, rtol=1e-6)
        np.testing.assert_allclose(r.as_numpy("OUTPUT1"), x - y, rtol=1e-6)
        r = c.infer("chain", [tensor("X", a)])   # double, then scale version 2: 2a * 3 - a
        np.testing.assert_allclose(r.as_numpy("Y"), 5 * a)
        if HAS_ONNX:
            np.testing.assert_allclose(c.infer("plus", [tensor("x", a)]).as_numpy("y"), a + 5)
    finally:
        c.close()
    # what the files ask that tgw does not honour: one warning line per model, at start
    log = broker.output()
    line = next(x for x in log.splitlines() if "model repository: model scale: not honoured: " in x)
    assert "instance_group: kind (KIND_CPU" in line and "instance_group: count (one instance per worker" in line
    assert log.count("model repository: model scale:") == 1 and "model repository: model double" not in log
