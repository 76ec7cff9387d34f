"""Triton Python-backend models served unchanged as stages by one real broker, driven with
tritonclient over HTTP and gRPC (tests/triton_py_models.py writes them): python_backend's add_sub
example as published, through docs/MIGRATING.md's example entry, and with its own config.pbtxt
(max_batch_size 0); a BYTES model handed its config.pbtxt (as tritonrepo translates it) that
reads its parameters and initialize(args); one execute() call per batch with one request per
caller, a response with an error failing only its request with the model's message and
Triton's status; a model whose initialize() raises refused at load with its file:line, the old
version serving on; finalize() run when a version unloads and when the broker stops."""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml
from tritonclient.utils import InferenceServerException

import triton_py_models as models
from conftest import readme_block, wait_until
from tgw.client import Client
from tgw.shm.errors import TgwError
from tgw.shm.wire import LoadVersion
from tgw.testing.child import BrokerProc
from tgw.testing.lifecycle import control

HANDLER = "{}/1/model.py:TritonPythonModel"


def config(root: str) -> dict:
    f32 = lambda *names: [{"name": n, "dtype": "float32", "shape": [4]} for n in names]   # noqa: E731
    i64 = lambda *names: [{"name": n, "dtype": "int64", "shape": [1]} for n in names]     # noqa: E731
    # docs/MIGRATING.md's example entry, as printed
    entries = [*yaml.safe_load(readme_block("triton-python-example:config"))["models"],
        {"name": "strings", "versions": [{"version": "1", "handler": HANDLER.format("strings")}],
         "options": {"triton_model_config": models.config_dict(models.STRINGS_CONFIG)},
         "inputs": [{"name": "TEXT", "dtype": "bytes", "shape": [1]}],
         "outputs": [{"name": "UPPER", "dtype": "bytes", "shape": [1]}, {"name": "LENGTH", "dtype": "int32", "shape": [1]}],
         "max_batch_size": 8},
        # the example with its own config.pbtxt: max_batch_size 0, no batch dim
        {"name": "add_sub0", "versions": [{"version": "1", "handler": HANDLER.format("add_sub")}],
         "options": {"triton_model_config": models.config_dict(models.ADD_SUB_CONFIG)}, "max_batch_size": 0,
         "inputs": f32("INPUT0", "INPUT1"), "outputs": f32("OUTPUT0", "OUTPUT1")},
        # held until 4 rows came: two callers' requests of 2 rows in one execute() call
        {"name": "picky", "versions": [{"version": "1", "handler": HANDLER.format("picky")}],
         "inputs": i64("X"), "outputs": i64("Y", "NREQ"), "max_batch_size": 4, "max_delay_us": 5_000_000}]
    return {"model_roots": [root], "http": {"port": 0}, "grpc": {"port": 0},
            "workers": {"devices": ["cpu"], "threads_per_worker": 1, "input_arena_mb": 4, "output_arena_mb": 2},
            "models": entries}


@pytest.fixture(scope="module")
def broker():
    d = os.path.realpath(tempfile.mkdtemp(prefix="tgwtp-", dir="/tmp"))   # ipc paths must stay short
    models.write(d)
    b = BrokerProc(config(d), d).start()
    b.root = d
    with Client(b.address) as c:
        b.http, b.grpc = c.status()["http"], c.status()["grpc"]
    yield b
    code = b.stop()
    # the version serving at the end (after the last test's swap) is finalized as its worker exits
    finalized = os.path.exists(os.path.join(d, "picky", "finalized-3"))
    shutil.rmtree(d, ignore_errors=True)
    assert code == 0, f"broker exited {code} on SIGTERM:\n{b.output()}"
    assert finalized, "picky version 3's finalize() did not run when the broker stopped"


@pytest.fixture
def client(broker):
    c = httpclient.InferenceServerClient(broker.http.removeprefix("http://"), concurrency=2)
    yield c
    c.close()


def tensor(name: str, value: np.ndarray, datatype: str, binary: bool = True) -> httpclient.InferInput:
    x = httpclient.InferInput(name, list(value.shape), datatype)
    x.set_data_from_numpy(value, binary_data=binary)
    return x


def test_the_add_sub_example_runs_unchanged(client):
    a, b = np.arange(8, dtype=np.float32).reshape(2, 4), np.full((2, 4), 0.5, np.float32)
    result = client.infer("add_sub", [tensor("INPUT0", a, "FP32"), tensor("INPUT1", b, "FP32")])
    assert result.as_numpy("OUTPUT0").tolist() == (a + b).tolist()
    assert result.as_numpy("OUTPUT1").tolist() == (a - b).tolist()
    assert [o["datatype"] for o in client.get_model_metadata("add_sub")["outputs"]] == ["FP32", "FP32"]
    # as python_backend's examples/add_sub/client.py calls it: shape [4], no batch dim
    a, b = np.random.rand(4).astype(np.float32), np.random.rand(4).astype(np.float32)
    result = client.infer("add_sub0", [tensor("INPUT0", a, "FP32"), tensor("INPUT1", b, "FP32")])
    assert result.as_numpy("OUTPUT0").tolist() == (a + b).tolist() and result.as_numpy("OUTPUT1").shape == (4,)


def test_a_bytes_model_reads_its_config_and_args(broker, client):
    text = np.array([[b"abc"], ["h\u00e9".encode()], [b""]], dtype=np.object_)
    for binary in (True, False):
        result = client.infer("strings", [tensor("TEXT", text, "BYTES", binary)],
                              outputs=[httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("UPPER", "LENGTH")])
        upper = [x if isinstance(x, bytes) else x.encode() for x in result.as_numpy("UPPER").ravel()]
        assert upper == [b"ABC!", "H\u00e9!".encode(), b"!"], binary   # bytes.upper() leaves non-ASCII alone
        assert result.as_numpy("LENGTH").dtype == np.int32 and result.as_numpy("LENGTH").ravel().tolist() == [3, 3, 0]
    with open(os.path.join(broker.root, "strings", "args.json")) as f:
        args = json.load(f)
    assert args == {"model_name": "strings", "model_version": "1", "model_repository": f"{broker.root}/strings",
                    "model_instance_kind": "CPU", "model_instance_name": "strings_0_0", "model_instance_device_id": "0",
                    "max_batch_size": 8, "dims": [1]}   # dims: numbers, as Triton writes them (not protobuf's strings)


def test_over_grpc_too(broker):
    c = grpcclient.InferenceServerClient(broker.grpc)
    try:
        a, b = np.arange(4, dtype=np.float32), np.ones(4, np.float32)
        inputs = [grpcclient.InferInput(n, [4], "FP32") for n in ("INPUT0", "INPUT1")]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(b)
        assert c.infer("add_sub0", inputs).as_numpy("OUTPUT1").tolist() == (a - b).tolist()
        x = grpcclient.InferInput("X", [4, 1], "INT64")
        x.set_data_from_numpy(np.array([[1], [2], [-3], [4]], np.int64))
        with pytest.raises(InferenceServerException) as info:
            c.infer("picky", [x])
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT", info.value
        assert re.fullmatch(r"negative input in request \d+", info.value.message()), info.value
    finally:
        c.close()


def test_an_error_response_fails_only_its_request(client):
    good = client.async_infer("picky", [tensor("X", np.array([[1], [2]], np.int64), "INT64")])
    bad = client.async_infer("picky", [tensor("X", np.array([[3], [-4]], np.int64), "INT64")])
    result = good.get_result()
    assert result.as_numpy("Y").ravel().tolist() == [2, 4]
    assert result.as_numpy("NREQ").ravel().tolist() == [2, 2]   # one execute() call, one request per caller
    with pytest.raises(InferenceServerException) as info:
        bad.get_result()
    # the model's own message, nothing in front; INVALID_ARG answers 400, as in Triton
    assert re.fullmatch(r"negative input in request \d+", info.value.message()) and info.value.status() == "400", \
        info.value
    zero = client.async_infer("picky", [tensor("X", np.array([[0]], np.int64), "INT64")])
    rest = client.async_infer("picky", [tensor("X", np.array([[1], [1], [1]], np.int64), "INT64")])
    with pytest.raises(InferenceServerException) as info:
        zero.get_result()
    assert info.value.message() == "zero input" and info.value.status() == "500", info.value   # INTERNAL, the default
    assert rest.get_result().as_numpy("NREQ").ravel().tolist() == [2, 2, 2]


def test_initialize_raising_is_refused_with_file_line_and_finalize_runs_on_unload(broker, client):
    root = broker.root
    with pytest.raises(TgwError) as info:
        control(broker.address, LoadVersion(v=0, model="picky", version="2", handler=f"{root}/{HANDLER.format('broken')}"))
    where = f"{root}/broken/1/model.py:{models.line_of(models.BROKEN, 'raise pb_utils')}"
    assert f"initialize() raised TritonModelException: no weights in {root}/broken (at {where})" in info.value.message, \
        info.value.message
    control(broker.address, LoadVersion(v=0, model="picky", version="3", handler=f"{root}/{HANDLER.format('picky')}"))
    wait_until(lambda: os.path.exists(os.path.join(root, "picky", "finalized-1")), what="version 1's finalize()")
    assert not os.path.exists(os.path.join(root, "picky", "finalized-3"))
    rows = [client.async_infer("picky", [tensor("X", np.array([[k]], np.int64), "INT64")]) for k in (5, 6)]
    rows += [client.async_infer("picky", [tensor("X", np.array([[7], [8]], np.int64), "INT64")])]
    assert [r.get_result().as_numpy("Y").ravel().tolist() for r in rows] == [[10], [12], [14, 16]]
