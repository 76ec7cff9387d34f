"""Triton's repository load with a config override and model files (docs/HTTP.md, "Load with a
config and files"), sent by the real tritonclient.http and tritonclient.grpc to a real broker with
server.allow_model_uploads and a token: refused without the token, for paths that would leave the
model's folder and for files without a config; accepted, the files written under the first model
root, and served - then replaced by a second load of the same name, and overridden by a config
alone (an uploaded model's folder, a Triton repository model's own). The switch itself (off:
every such load refused) is tests/unit/test_upload_checks.py's."""
from __future__ import annotations

import json
import os
import signal
import tempfile

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import base_config, served, wait_until
from tgw.client import Client

TOKEN = "upl0ad-token-value"


def auth() -> dict:
    """The token's header, a fresh dict each call: tritonclient.http adds its own headers to the one given."""
    return {"authorization": f"Bearer {TOKEN}"}   # lower case: gRPC metadata keys are


CONFIG = json.dumps({"backend": "pytorch", "max_batch_size": 8,
                     "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [3]}],
                     "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [3]}]})


class Scale(torch.nn.Module):
    def __init__(self, k: float):
        super().__init__()
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.k


def torchscript(k: float) -> bytes:
    path = tempfile.mktemp(suffix=".pt", dir="/tmp")
    torch.jit.save(torch.jit.script(Scale(k)), path)
    with open(path, "rb") as f:
        data = f.read()
    os.unlink(path)
    return data


@pytest.fixture(scope="module")
def broker(model_files):
    d = tempfile.mkdtemp(prefix="tgwu-", dir="/tmp")
    with open(os.path.join(d, "token"), "w") as f:
        f.write(TOKEN + "\n")
    os.chmod(os.path.join(d, "token"), 0o600)
    cfg = base_config(model_files, "double", server={"auth_token_file": os.path.join(d, "token"),
                                                     "allow_model_uploads": True})
    repo = os.path.join(d, "repo", "scaled")   # a Triton repository's model: a config alone overrides it
    os.makedirs(os.path.join(repo, "1"))
    with open(os.path.join(repo, "1", "model.pt"), "wb") as f:
        f.write(torchscript(5.0))
    with open(os.path.join(repo, "config.pbtxt"), "w") as f:
        f.write('backend: "pytorch"\nmax_batch_size: 8\ninput [{name: "x", data_type: TYPE_FP32, dims: [3]}]\n'
                'output [{name: "y", data_type: TYPE_FP32, dims: [3]}]\n')
    cfg.update(model_roots=[d, os.path.dirname(model_files["double"][0])], http={"port": 0}, grpc={"port": 0},
               model_repository=os.path.join(d, "repo"))
    os.environ["TGW_TOKEN"] = TOKEN   # the native client's
    try:
        yield from served(cfg, d, http=True, grpc=True, dir=d)
    finally:
        os.environ.pop("TGW_TOKEN", None)


@pytest.fixture(scope="module")
def clients(broker):
    pair = (httpclient.InferenceServerClient(broker.http.removeprefix("http://")),
            grpcclient.InferenceServerClient(broker.grpc))
    yield pair
    for c in pair:
        c.close()


def refused(call) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        call()
    return info.value


def test_refused_without_the_token_outside_the_folder_and_without_a_config(broker, clients):
    pt = torchscript(2.0)
    for c in clients:
        err = refused(lambda: c.load_model("up", config=CONFIG, files={"file:1/model.pt": pt}))
        assert "missing or wrong token" in err.message(), err
        for path in ("../../escape.pt", "1/../../escape.pt", "/tmp/escape.pt", "1//model.pt"):
            err = refused(lambda: c.load_model("up", config=CONFIG, files={f"file:{path}": pt}, headers=auth()))
            assert err.message().startswith("failed to load 'up', parameter 'file:") and "without '..'" in \
                err.message(), err
        err = refused(lambda: c.load_model("up", files={"file:1/model.pt": pt}, headers=auth()))
        assert err.message().startswith("failed to load 'up', failed to poll from model repository"), err
        err = refused(lambda: c.load_model("double", config=CONFIG, headers=auth()))   # no repository folder
        assert "needs a model from a Triton repository" in err.message(), err
    assert not os.path.exists(os.path.join(broker.dir, "escape.pt")) and not os.path.exists("/tmp/escape.pt")
    assert not os.path.exists(os.path.join(broker.dir, "uploads")) or \
        os.listdir(os.path.join(broker.dir, "uploads")) == []


def test_a_model_loaded_with_its_config_and_files_is_served_and_replaced(broker, clients):
    http, grpc_c = clients
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    http.load_model("up", config=CONFIG, files={"file:1/model.pt": torchscript(2.0)}, headers=auth())
    assert os.path.isfile(os.path.join(broker.dir, "uploads", "up.1", "up", "1", "model.pt"))
    inp = grpcclient.InferInput("x", [2, 3], "FP32")
    inp.set_data_from_numpy(x)
    np.testing.assert_array_equal(grpc_c.infer("up", [inp], headers=auth()).as_numpy("y"), x * 2)
    assert grpc_c.is_model_ready("up", "1", headers=auth())
    # the same name again, over gRPC (files as bytes): it replaces the first
    grpc_c.load_model("up", config=CONFIG, files={"file:1/model.pt": torchscript(3.0)}, headers=auth())
    np.testing.assert_array_equal(grpc_c.infer("up", [inp], headers=auth()).as_numpy("y"), x * 3)
    assert os.listdir(os.path.join(broker.dir, "uploads")) == ["up.2"]   # the replaced folder removed
    h = httpclient.InferInput("x", [2, 3], "FP32")
    h.set_data_from_numpy(x)
    np.testing.assert_array_equal(http.infer("up", [h], headers=auth()).as_numpy("y"), x * 3)
    # a config alone keeps the model's folder (Triton: the repository's files)
    http.load_model("up", config=CONFIG.replace('"max_batch_size": 8', '"max_batch_size": 2'), headers=auth())
    assert http.get_model_config("up", headers=auth())["max_batch_size"] == 2
    np.testing.assert_array_equal(http.infer("up", [h], headers=auth()).as_numpy("y"), x * 3)
    assert os.listdir(os.path.join(broker.dir, "uploads")) == ["up.2"]
    # a repository's model, its config overridden: its own files serve on
    assert http.get_model_config("scaled", headers=auth())["max_batch_size"] == 8
    grpc_c.load_model("scaled", config=CONFIG.replace('"max_batch_size": 8', '"max_batch_size": 4'), headers=auth())
    assert grpc_c.get_model_config("scaled", headers=auth()).config.max_batch_size == 4
    np.testing.assert_array_equal(http.infer("scaled", [h], headers=auth()).as_numpy("y"), x * 5)
    rows = {(r["name"], r["version"], r["state"]) for r in http.get_model_repository_index(headers=auth())}
    assert ("up", "1", "READY") in rows and ("double", "1", "READY") in rows
    # a reload of the config file (SIGHUP) keeps what the loads put in place
    with Client(broker.address) as native:
        os.kill(broker.proc.pid, signal.SIGHUP)
        outcome = wait_until(lambda: native.status().get("reload", {}).get("ok") is not None and
                             native.status()["reload"], what="the reload done")
        assert outcome["ok"], outcome
    assert grpc_c.get_model_config("scaled", headers=auth()).config.max_batch_size == 4
    np.testing.assert_array_equal(http.infer("up", [h], headers=auth()).as_numpy("y"), x * 3)
