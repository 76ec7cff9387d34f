"""Triton's protocol to the letter, driven by the real tritonclient over HTTP and gRPC: models
without a batch dim (max_batch_size 0: a TorchScript model and a stage), the classification
extension with a label file, an input's format and reshape, and Triton's words and status for
the tensor checks its clients match.

One broker for the module, its models built here: "flat" (max_batch_size 0, x [3, 4] -> y [4]
= x.sum(0): a batch dim would give it a wrong shape; "flatexport": the same as a torch.export
program), "square" (batched; input "img" [4] in
FORMAT_NCHW given to the model as [2, 2], output "y" [4] from the model's [2, 2]; labels on y),
and "flatstage" (a stage with max_batch_size 0)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import served
from tgw.workers.demo_models import save_model

LABELS = ["zero", "one", "two", "three"]
STAGE = '''
class Flat:
    def __call__(self, batch):
        x = batch["x"]
        assert x.dim() == 1, f"the stage got {list(x.shape)}"   # no batch dim for max_batch_size 0
        return {"y": x * 2}
'''


class Flat(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert x.dim() == 2   # [3, 4], no batch dim
        return x.sum(0)


class Square(torch.nn.Module):
    def forward(self, img: torch.Tensor) -> torch.Tensor:
        assert img.dim() == 3   # [rows, 2, 2]: the declared reshape
        return img * 2


@pytest.fixture(scope="module")
def broker():
    d = tempfile.mkdtemp(prefix="tgwtp-", dir="/tmp")
    torch.jit.script(Flat()).save(os.path.join(d, "flat.pt"))
    save_model(Flat(), (torch.zeros(3, 4),), os.path.join(d, "flat.pt2"), "export")   # no batch dim in the program
    torch.jit.script(Square()).save(os.path.join(d, "square.pt"))
    with open(os.path.join(d, "labels.txt"), "w") as f:
        f.write("\n".join(LABELS) + "\n")
    with open(os.path.join(d, "flat_stage.py"), "w") as f:
        f.write(STAGE)
    cfg = {"model_roots": [d], "grpc": {"port": 0}, "http": {"port": 0},
           "workers": {"devices": ["cpu"], "threads_per_worker": 1, "input_arena_mb": 8, "output_arena_mb": 4},
           "models": [
               {"name": "flat", "versions": [{"version": "1", "path": "flat.pt"}], "max_batch_size": 0,
                "inputs": [{"name": "x", "dtype": "float32", "shape": [3, 4]}],
                "outputs": [{"name": "y", "dtype": "float32", "shape": [4], "labels": "labels.txt"}]},
               {"name": "flatexport", "versions": [{"version": "1", "path": "flat.pt2"}], "max_batch_size": 0,
                "inputs": [{"name": "x", "dtype": "float32", "shape": [3, 4]}],
                "outputs": [{"name": "y", "dtype": "float32", "shape": [4]}]},
               {"name": "square", "versions": [{"version": "1", "path": "square.pt"}], "max_batch_size": 8,
                "inputs": [{"name": "img", "dtype": "float32", "shape": [4], "format": "FORMAT_NCHW",
                            "reshape": [2, 2]}],
                "outputs": [{"name": "y", "dtype": "float32", "shape": [4], "reshape": [2, 2],
                             "labels": "labels.txt"}]},
               {"name": "flatstage", "versions": [{"version": "1", "handler": "flat_stage.py:Flat"}],
                "max_batch_size": 0, "inputs": [{"name": "x", "dtype": "float32", "shape": [3]}],
                "outputs": [{"name": "y", "dtype": "float32", "shape": [3]}]}]}
    yield from served(cfg, d, http=True, grpc=True)


@pytest.fixture(scope="module")
def clients(broker):
    h = httpclient.InferenceServerClient(broker.http.removeprefix("http://"))
    g = grpcclient.InferenceServerClient(broker.grpc)
    yield {"http": (h, httpclient), "grpc": (g, grpcclient)}
    h.close()
    g.close()


def infer(clients, face: str, model: str, inputs: dict, outputs: list | None = None):
    c, mod = clients[face]
    ins = []
    for name, (value, datatype) in inputs.items():
        inp = mod.InferInput(name, list(value.shape), datatype)
        inp.set_data_from_numpy(value)
        ins.append(inp)
    return c.infer(model, ins, outputs=outputs)


FACES = ["http", "grpc"]


@pytest.mark.parametrize("face", FACES)
def test_no_batch_dim_answers_with_the_shapes_as_declared(clients, face):
    """image_client's `max_batch_size == 0` branch: the metadata and config show no batch dim and
    the request carries the full shape; the model (and a stage) gets no batch dim."""
    c, _ = clients[face]
    meta = c.get_model_metadata("flat")
    config = c.get_model_config("flat")
    if face == "grpc":
        meta = {"inputs": [{"shape": list(t.shape)} for t in meta.inputs]}
        config = {"max_batch_size": config.config.max_batch_size}
    assert meta["inputs"][0]["shape"] == [3, 4] and config["max_batch_size"] == 0
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    y = infer(clients, face, "flat", {"x": (x, "FP32")}).as_numpy("y")
    assert y.shape == (4,) and y.tolist() == x.sum(0).tolist()
    assert infer(clients, face, "flatexport", {"x": (x, "FP32")}).as_numpy("y").tolist() == x.sum(0).tolist()
    s = infer(clients, face, "flatstage", {"x": (np.ones(3, np.float32), "FP32")}).as_numpy("y")
    assert s.tolist() == [2.0, 2.0, 2.0]
    with pytest.raises(InferenceServerException) as err:   # a batch dim is a wrong shape here
        infer(clients, face, "flat", {"x": (x[None], "FP32")})
    assert err.value.message() == "unexpected shape for input 'x' for model 'flat'. Expected [3,4], got [1,3,4]. "


@pytest.mark.parametrize("face", FACES)
def test_reshape_and_classification(clients, face):
    """The request uses the declared shape, the model its reshape; top-k as "value:index:label",
    per row ([rows, k]; [k] without a batch dim)."""
    _, mod = clients[face]
    img = np.array([[0.5, 3.0, 1.0, 2.0], [4.0, 0.0, 0.0, 1.0]], dtype=np.float32)
    y = infer(clients, face, "square", {"img": (img, "FP32")}).as_numpy("y")
    assert y.shape == (2, 4) and y.tolist() == (img * 2).tolist()
    top = infer(clients, face, "square", {"img": (img, "FP32")},
                [mod.InferRequestedOutput("y", class_count=2)]).as_numpy("y")
    assert top.shape == (2, 2) and top.tolist() == [[b"6.000000:1:one", b"4.000000:3:three"],
                                                    [b"8.000000:0:zero", b"2.000000:3:three"]]
    x = np.array([[1, 0, 0, 9], [0, 0, 0, 0], [0, 0, 5, 0]], dtype=np.float32)
    top = infer(clients, face, "flat", {"x": (x, "FP32")}, [mod.InferRequestedOutput("y", class_count=9)]).as_numpy("y")
    assert top.tolist() == [b"9.000000:3:three", b"5.000000:2:two", b"1.000000:0:zero", b"0.000000:1:one"]


def test_the_config_document_shows_format_reshape_and_labels(clients):
    cfg = clients["http"][0].get_model_config("square")
    assert cfg["platform"] == "pytorch_libtorch" and cfg["input"][0]["format"] == "FORMAT_NCHW"
    assert cfg["input"][0]["reshape"] == {"shape": [2, 2]} and cfg["output"][0]["label_filename"] == "labels.txt"
    g = clients["grpc"][0].get_model_config("square").config
    assert g.input[0].format == 2 and list(g.input[0].reshape.shape) == [2, 2]   # 2: FORMAT_NCHW
    assert clients["http"][0].get_model_config("flatstage")["platform"] == "python"


def post(broker, model: str, body: dict) -> tuple[int, dict, dict]:
    req = urllib.request.Request(f"{broker.http}/v2/models/{model}/infer", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


@pytest.mark.parametrize("face", FACES)
def test_tensor_checks_read_as_tritons(broker, clients, face):
    """The message is Triton's text; HTTP 400 (via tritonclient: the message) / INVALID_ARGUMENT."""
    _, mod = clients[face]
    img = np.ones((1, 4), np.float32)
    cases = [
        ({"pic": (img, "FP32")}, None, "unexpected inference input 'pic' for model 'square'"),
        ({"img": (img.astype(np.float64), "FP64")}, None,
         "inference input 'img' data-type is 'FP64', but model 'square' expects 'FP32'"),
        ({"img": (np.ones((1, 5), np.float32), "FP32")}, None,
         "unexpected shape for input 'img' for model 'square'. Expected [-1,4], got [1,5]. NOTE: Setting a non-zero "
         "max_batch_size in the model config requires a batch dimension to be prepended to each input shape."),
        ({"img": (img, "FP32")}, [mod.InferRequestedOutput("z")], "unexpected inference output 'z' for model 'square'"),
    ]
    for inputs, outputs, words in cases:
        with pytest.raises(InferenceServerException) as err:
            infer(clients, face, "square", inputs, outputs)
        assert err.value.message().startswith(words), err.value.message()
        if face == "grpc":
            assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
        else:
            assert err.value.status() == "400"


def test_http_body_checks_read_as_tritons(broker):
    """What tritonclient never sends but hand-written clients do; tgw's code in a header."""
    x = {"name": "img", "shape": [1, 4], "datatype": "FP32"}
    status, headers, doc = post(broker, "square", {"inputs": [{**x, "data": [1, 2, 3, 4],
                                                             "parameters": {"binary_data_size": 16}}]})
    assert status == 400 and doc["error"] == (
        "Input must set only one of the following fields: 'data', 'binary_data_size' in 'parameters', "
        "'shared_memory_region' in 'parameters'. But set 'data' 'binary_data_size'")
    assert headers["tgw-code"] == "INVALID_ARGUMENT" and doc["code"] == "INVALID_ARGUMENT"
    status, _, doc = post(broker, "square", {"inputs": [{**x, "data": [1, 2, 3]}]})
    assert status == 400 and doc["error"] == "Failed to parse 'data' field: shape does not match true shape"
    status, _, doc = post(broker, "flat", {"inputs": []})
    assert status == 400 and doc["error"] == ("expected 1 inputs but got 0 inputs for model 'flat'. Got input(s) [], "
                                              "but missing required input(s) ['x']. Please provide all required input(s).")
    status, _, doc = post(broker, "square", {"inputs": [{**x, "data": [1, 2, 3, 4]}],
                                              "outputs": [{"name": "y", "parameters": {"classification": -1}}]})
    assert status == 400 and doc["error"].startswith("Unable to set 'classification'")


def test_a_reload_reads_the_label_file_again_and_refuses_a_missing_one(broker, clients):
    """Last in the module: it rewrites the label file."""
    labels = os.path.join(os.path.dirname(broker.config_path), "labels.txt")
    reload = [sys.executable, "-m", "tgw.broker", "reload", "--address", broker.address, "--json"]
    ask = [httpclient.InferRequestedOutput("y", class_count=1)]
    img = np.array([[0, 0, 0, 1]], dtype=np.float32)
    with open(labels, "w") as f:
        f.write("a\nb\nc\nd\n")
    out = subprocess.run(reload, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out
    assert infer(clients, "http", "square", {"img": (img, "FP32")}, ask).as_numpy("y").tolist() == [[b"2.000000:3:d"]]
    os.remove(labels)
    out = subprocess.run(reload, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "outputs.0.labels: label file" in out.stderr, out
    assert infer(clients, "http", "square", {"img": (img, "FP32")}, ask).as_numpy("y").tolist() == [[b"2.000000:3:d"]]
