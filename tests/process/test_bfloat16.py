"""bfloat16 end to end: a TorchScript model with a bfloat16 input and output (x * 2, exact in
bfloat16) served by a real broker; the native client sends ml_dtypes.bfloat16 arrays and torch
bfloat16 tensors, tritonclient.http sends BF16 in binary, JSON numbers go over plain HTTP."""
from __future__ import annotations

import json
import os
import tempfile
import urllib.request

import ml_dtypes
import numpy as np
import pytest
import torch
import tritonclient.http as httpclient

from tgw.client import Client
from conftest import served

BF16 = ml_dtypes.bfloat16


class Double(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


@pytest.fixture(scope="module")
def broker():
    d = tempfile.mkdtemp(prefix="tgwb-", dir="/tmp")
    path = os.path.join(d, "double_bf16.pt")
    torch.jit.script(Double()).save(path)
    cfg = {"workers": {"devices": ["cpu"], "threads_per_worker": 1, "input_arena_mb": 2, "output_arena_mb": 2},
           "http": {"port": 0},
           "models": [{"name": "bf", "versions": [{"version": "1", "path": path}], "max_batch_size": 8,
                       "inputs": [{"name": "x", "dtype": "bfloat16", "shape": [4]}],
                       "outputs": [{"name": "y", "dtype": "bfloat16", "shape": [4]}]}]}
    yield from served(cfg, d, http=True)


X = np.array([[1.5, -0.00390625, 3.0e38, 7.0], [0.1, -2.0, 1e-30, 0.0]], dtype=np.float32).astype(BF16)


def doubled(x: np.ndarray) -> bytes:
    """x * 2 in bfloat16 (3e38 * 2 is infinity there too)."""
    with np.errstate(over="ignore"):
        return (x.astype(np.float32) * 2).astype(BF16).tobytes()


def test_native_client_round_trips_bfloat16_exactly(broker):
    with Client(broker.address) as c:
        y = c.infer("bf", {"x": X})["y"]
        t = c.infer("bf", {"x": torch.from_numpy(X.view(np.int16)).view(torch.bfloat16)}, return_type="torch")["y"]
        (info,) = [m for m in c.models() if m["name"] == "bf"]
    assert y.dtype == BF16 and y.shape == (2, 4)
    assert y.tobytes() == doubled(X)
    assert t.dtype == torch.bfloat16 and t.view(torch.int16).numpy().tobytes() == y.tobytes()
    assert [i["dtype"] for i in info["inputs"]] == ["bfloat16"]


def test_tritonclient_sends_bf16_in_binary(broker):
    c = httpclient.InferenceServerClient(broker.http.removeprefix("http://"))
    try:
        x = httpclient.InferInput("x", [2, 4], "BF16")
        x.set_data_from_numpy(X, binary_data=True)
        result = c.infer("bf", [x], outputs=[httpclient.InferRequestedOutput("y", binary_data=True)])
        meta = c.get_model_metadata("bf")
    finally:
        c.close()
    y = result.as_numpy("y")
    assert y.dtype == BF16 and y.tobytes() == doubled(X)
    assert meta["inputs"][0]["datatype"] == "BF16" and meta["outputs"][0]["datatype"] == "BF16"


def test_json_numbers_in_and_floats_out(broker):
    doc = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "BF16", "data": [1.00390625, 0.1, -3, 2.5]}]}
    req = urllib.request.Request(f"{broker.http}/v2/models/bf/infer", data=json.dumps(doc).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        out = json.loads(r.read())["outputs"][0]
    want = (np.array(doc["inputs"][0]["data"], np.float32).astype(BF16).astype(np.float32) * 2).tolist()
    assert out["datatype"] == "BF16" and out["shape"] == [1, 4] and out["data"] == want
