"""Triton's protocol to the letter, over both faces of one real broker: BYTES tensors in system
shared-memory regions in Triton's layout (tritonclient.utils.shared_memory with numpy object
arrays, as Triton's simple_*_shm_string_client examples do), and the model-level errors in
Triton's words and status, which Triton's own qa tests match (L0_server_status, L0_lifecycle)."""
from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException, serialize_byte_tensor, serialized_byte_size

import stages
from conftest import base_config, served

WORDS = [b"abc", b"\x00\xff\x01", b"", "h\u00e9llo".encode(), b"x" * 300]


@pytest.fixture(scope="module")
def broker(model_files):
    d = tempfile.mkdtemp(prefix="tgwt-", dir="/tmp")
    os.makedirs(os.path.join(d, "stages"))
    shutil.copy(stages.__file__, os.path.join(d, "stages", "stages.py"))
    cfg = base_config(model_files, "mlp", "double")
    cfg["models"].append(stages.stage_entry("stages/stages.py", "Echo"))
    cfg.update(model_roots=[d, os.path.dirname(model_files["mlp"][0])], http={"port": 0, "allow_client_shm": True},
               grpc={"port": 0, "allow_client_shm": True})
    yield from served(cfg, d, http=True, grpc=True)


@pytest.fixture(scope="module")
def clients(broker):
    pair = (httpclient.InferenceServerClient(broker.http.removeprefix("http://")),
            grpcclient.InferenceServerClient(broker.grpc))
    yield pair
    for c in pair:
        c.unregister_system_shared_memory()
        c.close()


def refused(call) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        call()
    return info.value


@pytest.mark.parametrize("face", ["http", "grpc"])
def test_bytes_tensors_in_system_regions_both_ways(clients, face):
    c, client = clients[face == "grpc"], grpcclient if face == "grpc" else httpclient
    data = np.array(WORDS, dtype=object)
    packed = serialize_byte_tensor(data)
    size = serialized_byte_size(packed)
    key = f"/tgwtest_{os.getpid()}_{face}_bytes"
    handle = shm.create_shared_memory_region(f"{face}_in", key, 4096)
    try:
        shm.set_shared_memory_region(handle, [packed], offset=16)
        c.register_system_shared_memory(f"{face}_in", key, 4096)
        inp = client.InferInput("data", [len(WORDS)], "BYTES")
        inp.set_shared_memory(f"{face}_in", size, offset=16)
        out, length = client.InferRequestedOutput("data"), client.InferRequestedOutput("length")
        out.set_shared_memory(f"{face}_in", 2048, offset=2048)
        result = c.infer("echo", [inp], outputs=[out, length])
        got = shm.get_contents_as_numpy(handle, np.object_, [len(WORDS)], offset=2048)
        assert got.tolist() == WORDS
        assert result.as_numpy("length").tolist() == [len(w) for w in WORDS]
        if face == "http":   # the bytes written, as for any output in a region
            assert result.get_output("data")["parameters"]["shared_memory_byte_size"] == size
        # a layout that does not hold the shape's elements is refused, naming why
        inp = client.InferInput("data", [len(WORDS) + 1], "BYTES")
        inp.set_shared_memory(f"{face}_in", size, offset=16)
        err = refused(lambda: c.infer("echo", [inp]))
        assert "not 6 BYTES elements" in err.message() and "inside its 4-byte length" in err.message(), err
        # an output slice too small for the layout
        inp = client.InferInput("data", [len(WORDS)], "BYTES")
        inp.set_shared_memory(f"{face}_in", size, offset=16)
        out.set_shared_memory(f"{face}_in", size - 1, offset=2048)
        err = refused(lambda: c.infer("echo", [inp], outputs=[out]))
        assert f"holds {size} bytes" in err.message() and "too small" in err.message(), err
    finally:
        c.unregister_system_shared_memory(f"{face}_in")
        shm.destroy_shared_memory_region(handle)


def status(face: str, err: InferenceServerException) -> str:
    return err.status() if face == "http" else err.status().removeprefix("StatusCode.")


@pytest.mark.parametrize("face", ["http", "grpc"])
def test_model_errors_in_tritons_words_and_status(clients, face):
    c, client = clients[face == "grpc"], grpcclient if face == "grpc" else httpclient
    cases = [(lambda: c.get_model_metadata("nope"), "Request for unknown model: 'nope' is not found",
              ("404", "NOT_FOUND")),
             (lambda: c.get_model_metadata("mlp", "99"), "Request for unknown model: 'mlp' version 99 is not found",
              ("404", "NOT_FOUND")),
             (lambda: c.get_model_config("mlp", "abc"), "failed to get model version from specified version string "
              "'abc' (details: stol), version should be an integral value > 0", ("400", "INVALID_ARGUMENT"))]
    x = client.InferInput("x", [1, 256], "FP32")
    x.set_data_from_numpy(np.zeros((1, 256), np.float32))
    cases += [(lambda: c.infer("nope", [x]), "Request for unknown model: 'nope' is not found", ("404", "NOT_FOUND")),
              (lambda: c.infer("mlp", [x], model_version="7"), "Request for unknown model: 'mlp' version 7 is not "
               "found", ("404", "NOT_FOUND"))]
    for call, message, codes in cases:
        err = refused(call)
        assert (err.message(), status(face, err)) == (message, codes[face == "grpc"]), err
    err = refused(lambda: c.load_model("unknown_model"))   # L0_lifecycle's test_model_control matches this
    assert err.message().startswith("failed to load 'unknown_model', failed to poll from model repository"), err


def test_a_model_with_no_version_loaded(clients):
    """Unloaded, a model answers as Triton's does when none of its versions is available."""
    http, grpc_c = clients
    x = {face: client.InferInput("x", [1, 3], "FP32") for face, client in (("http", httpclient), ("grpc", grpcclient))}
    for inp in x.values():
        inp.set_data_from_numpy(np.ones((1, 3), np.float32))
    http.unload_model("double")
    try:
        for face, c in (("http", http), ("grpc", grpc_c)):
            err = refused(lambda: c.infer("double", [x[face]]))
            assert (err.message(), status(face, err)) == (
                "Request for unknown model: 'double' has no available versions", "404" if face == "http" else
                "NOT_FOUND"), err
    finally:
        http.load_model("double")
    assert grpc_c.infer("double", [x["grpc"]]).as_numpy("y").tolist() == [[2, 2, 2]]
