"""Triton's client shared memory over HTTP (docs/SHARED_MEMORY.md): a real broker with
`http.allow_client_shm`, driven by the real tritonclient.http and tritonclient.utils.shared_memory;
results checked against the native client's for the same inputs (the same workers compute both,
so they are equal to the bit). CUDA regions run on a GPU in tests/gpu/test_triton_cuda_shm.py;
here, their refusals and status."""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import tempfile
import urllib.request

import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from conftest import base_config, readme_block, served
from tgw.client import Client

MAX_REGION_BYTES = 1 << 20


@pytest.fixture(scope="module")
def shm_broker(model_files):
    d = tempfile.mkdtemp(prefix="tgws-", dir="/tmp")
    cfg = base_config(model_files, "mlp", "mixed", server={"max_region_bytes": MAX_REGION_BYTES})
    cfg.update(http={"port": 0, "allow_client_shm": True})
    yield from served(cfg, d, http=True)


@pytest.fixture(scope="module")
def triton(shm_broker):
    c = httpclient.InferenceServerClient(shm_broker.http.removeprefix("http://"))
    yield c
    c.unregister_system_shared_memory()
    c.close()


@pytest.fixture(scope="module")
def native(shm_broker):
    with Client(shm_broker.address) as c:
        yield c


@pytest.fixture
def region(triton):
    """A segment maker: (tritonclient handle, key); every segment and registration goes after."""
    made = []

    def make(name: str, size: int, register: bool = True, offset: int = 0):
        key = f"/tgwtest_{os.getpid()}_{name}"
        handle = shm.create_shared_memory_region(name, key, size)
        made.append(handle)
        if register:
            triton.register_system_shared_memory(name, key, size - offset, offset)
        return handle, key
    yield make
    triton.unregister_system_shared_memory()
    for handle in made:
        shm.destroy_shared_memory_region(handle)


def refusal(call, *words: str, status: str = "400") -> str:
    """The InferenceServerException `call` raises: its HTTP status, and words of its message."""
    with pytest.raises(InferenceServerException) as info:
        call()
    message = info.value.message()
    assert info.value.status() == status and all(w in message for w in words), (info.value.status(), message)
    return message


def mlp_request(x_region: str | None, x: np.ndarray, y_region: str | None = None, y_offset: int = 0,
                x_offset: int = 0):
    inp = httpclient.InferInput("x", list(x.shape), "FP32")
    if x_region is None:
        inp.set_data_from_numpy(x)
    else:
        inp.set_shared_memory(x_region, x.nbytes, x_offset)
    out = httpclient.InferRequestedOutput("y", binary_data=True)
    if y_region is not None:
        out.set_shared_memory(y_region, x.shape[0] * 10 * 4, y_offset)
    return [inp], [out]


def test_the_docs_example_runs_as_printed(shm_broker, triton):
    port = shm_broker.http.rsplit(":", 1)[1]
    code = readme_block("shm-example:python").replace(":8000", f":{port}")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "['x_region', 'y_region']" and lines[-1] == "(4, 10)", out.stdout
    assert lines[1] == "{'shared_memory_region': 'y_region', 'shared_memory_byte_size': 160}", out.stdout
    assert triton.get_system_shared_memory_status() == []


def test_inputs_and_outputs_in_regions_equal_native(triton, native, region):
    x = np.random.default_rng(5).standard_normal((3, 256), dtype=np.float32)
    want = native.infer("mlp", {"x": x})["y"]
    handle, _ = region("io", 8192)
    shm.set_shared_memory_region(handle, [x], offset=1024)
    inputs, outputs = mlp_request("io", x, "io", y_offset=4096, x_offset=1024)
    result = triton.infer("mlp", inputs, outputs=outputs)
    y = result.get_output("y")
    assert "data" not in y and y["parameters"] == {"shared_memory_region": "io", "shared_memory_byte_size": 120,
                                                   "shared_memory_offset": 4096}
    np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.float32, [3, 10], 4096), want)
    inputs, outputs = mlp_request("io", x, None, x_offset=1024)   # region in, bytes out
    np.testing.assert_array_equal(triton.infer("mlp", inputs, outputs=outputs).as_numpy("y"), want)
    inputs, outputs = mlp_request(None, x, "io", y_offset=0)       # bytes in, region out
    triton.infer("mlp", inputs, outputs=outputs)
    np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.float32, [3, 10], 0), want)


def test_regions_mix_with_binary_and_json_tensors(triton, native, region):
    a, b, c = np.ones((2, 4), np.float16) * 1.5, np.array([[True, False, True]] * 2), np.arange(10).reshape(2, 5)
    want = native.infer("mixed", {"a": a, "b": b, "c": c})
    handle, _ = region("mixed", 256)
    shm.set_shared_memory_region(handle, [a])
    ins = [httpclient.InferInput("a", [2, 4], "FP16"), httpclient.InferInput("b", [2, 3], "BOOL"),
           httpclient.InferInput("c", [2, 5], "INT64")]
    ins[0].set_shared_memory("mixed", a.nbytes)
    ins[1].set_data_from_numpy(b, binary_data=False)
    ins[2].set_data_from_numpy(c, binary_data=True)
    outs = [httpclient.InferRequestedOutput("a2"), httpclient.InferRequestedOutput("nb", binary_data=False),
            httpclient.InferRequestedOutput("csum")]
    outs[0].set_shared_memory("mixed", 16, 64)
    result = triton.infer("mixed", ins, outputs=outs)
    np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.float16, [2, 4], 64), want["a2"])
    np.testing.assert_array_equal(result.as_numpy("nb"), want["nb"])
    np.testing.assert_array_equal(result.as_numpy("csum"), want["csum"])


def test_status_unregister_and_extensions(triton, region):
    assert "system_shared_memory" in triton.get_server_metadata()["extensions"]
    _, key_a = region("a", 4096)
    _, key_b = region("b", 4096, offset=1024)
    assert triton.get_system_shared_memory_status("b") == [{"name": "b", "key": key_b, "offset": 1024,
                                                            "byte_size": 3072}]
    assert sorted(r["name"] for r in triton.get_system_shared_memory_status()) == ["a", "b"]
    refusal(lambda: triton.register_system_shared_memory("a", key_a, 16), "shared memory region 'a' already in manager")   # Triton's words
    triton.unregister_system_shared_memory("a")
    triton.unregister_system_shared_memory("a")   # gone already: no error, as in Triton
    refusal(lambda: triton.get_system_shared_memory_status("a"), "Unable to find system shared memory region: 'a'")
    assert [r["name"] for r in triton.get_system_shared_memory_status()] == ["b"]
    triton.unregister_system_shared_memory()
    assert triton.get_system_shared_memory_status() == []
    x = np.zeros((1, 256), np.float32)
    inputs, outputs = mlp_request("b", x)
    refusal(lambda: triton.infer("mlp", inputs, outputs=outputs), "Unable to find shared memory region: 'b'")


def test_every_bad_registration_and_request_is_refused(triton, region, tmp_path):
    handle, key = region("bad", 2048, register=False)
    refusal(lambda: triton.register_system_shared_memory("bad", key, 4096), "failed to register shared memory region 'bad': invalid args",
            "outside segment", "2048 bytes")
    refusal(lambda: triton.register_system_shared_memory("bad", "/tgwtest_none", 16),
            "Unable to open shared memory region: '/tgwtest_none'")
    refusal(lambda: triton.register_system_shared_memory("bad", "/tgw_ring_1_x", 16), "broker's own segments")
    refusal(lambda: triton.register_system_shared_memory("bad", "/a/b", 16), "not a POSIX shm name")
    refusal(lambda: triton.register_system_shared_memory("bad", key, 0), "byte_size must be")
    os.symlink(f"/dev/shm/{key.lstrip('/')}", f"/dev/shm/{key.lstrip('/')}_link")
    try:
        refusal(lambda: triton.register_system_shared_memory("bad", key + "_link", 16), "Unable to open")
    finally:
        os.unlink(f"/dev/shm/{key.lstrip('/')}_link")
    big, big_key = region("big", MAX_REGION_BYTES + 4096, register=False)
    refusal(lambda: triton.register_system_shared_memory("big", big_key, MAX_REGION_BYTES + 1),
            "server.max_region_bytes", status="413")
    if os.geteuid() == 0:   # a segment of another uid: only root can make one here
        os.chown(f"/dev/shm/{key.lstrip('/')}", 54321, -1)
        refusal(lambda: triton.register_system_shared_memory("bad", key, 16), "belongs to uid 54321", status="401")
        os.chown(f"/dev/shm/{key.lstrip('/')}", 0, -1)
    triton.register_system_shared_memory("bad", key, 2048)
    x = np.zeros((2, 256), np.float32)
    inputs, outputs = mlp_request("bad", x)   # 2048 bytes: fits
    inputs[0].set_shared_memory("bad", 1024)
    refusal(lambda: triton.infer("mlp", inputs, outputs=outputs), "input byte size mismatch for input 'x'. Expected 2048, got 1024")
    inputs[0].set_shared_memory("bad", 2048, 1024)
    refusal(lambda: triton.infer("mlp", inputs, outputs=outputs),
            "Invalid offset + byte size for shared memory region: 'bad'", "[1024, 3072)")
    inputs[0].set_shared_memory("bad", 8, 2048)
    refusal(lambda: triton.infer("mlp", inputs, outputs=outputs), "Invalid offset for shared memory region: 'bad'")
    inputs, outputs = mlp_request("bad", x, "bad")
    outputs[0].set_shared_memory("bad", 40)
    refusal(lambda: triton.infer("mlp", inputs, outputs=outputs), "holds 80 bytes", "too small")
    text = httpclient.InferInput("x", [1], "BYTES")
    text.set_shared_memory("bad", 16)
    refusal(lambda: triton.infer("mlp", [text]), "not 1 BYTES elements", "12 bytes follow")   # zeros: b"" + 12


def test_a_truncated_segment_fails_its_request_not_the_broker(triton, native, region):
    handle, key = region("cut", 4096)
    x = np.ones((1, 256), np.float32)
    shm.set_shared_memory_region(handle, [x])
    inputs, outputs = mlp_request("cut", x, "cut", y_offset=2048)
    triton.infer("mlp", inputs, outputs=outputs)
    os.truncate(f"/dev/shm/{key.lstrip('/')}", 512)       # the caller cuts its segment short
    refusal(lambda: triton.infer("mlp", inputs, outputs=outputs), "truncated")
    inputs, outputs = mlp_request(None, x, "cut", y_offset=2048)   # the output's place is gone too
    refusal(lambda: triton.infer("mlp", inputs, outputs=outputs), "truncated")
    assert os.stat(f"/dev/shm/{key.lstrip('/')}").st_size == 512   # not grown back
    assert triton.is_server_live() and native.infer("mlp", {"x": x})["y"].shape == (1, 10)


def post(url: str, doc: dict | None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(doc).encode() if doc is not None else b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_cuda_regions_need_a_worker_on_their_gpu(shm_broker, triton):
    assert "cuda_shared_memory" in triton.get_server_metadata()["extensions"]
    handle = base64.b64encode(bytes(64)).decode()
    refusal(lambda: triton.register_cuda_shared_memory("g", handle, 0, 1024), "cuda:0", "no worker")
    status, body = post(f"{shm_broker.http}/v2/cudasharedmemory/region/g/register",
                        {"raw_handle": {"b64": base64.b64encode(bytes(10)).decode()}, "device_id": 0, "byte_size": 8})
    assert (status, body["details"]["reason"]) == (400, "shm_cuda_handle"), body
    status, body = post(f"{shm_broker.http}/v2/cudasharedmemory/region/g/register", {"raw_handle": "x"})
    assert (status, body["details"]["reason"]) == (400, "shm_cuda_handle"), body
    assert triton.get_cuda_shared_memory_status() == []
    triton.unregister_cuda_shared_memory()
    refusal(lambda: triton.get_cuda_shared_memory_status("g"), "Unable to find cuda shared memory region: 'g'")


@pytest.fixture(scope="module")
def plain_broker(model_files):
    d = tempfile.mkdtemp(prefix="tgwp-", dir="/tmp")
    cfg = base_config(model_files, "mlp")
    cfg.update(http={"port": 0})
    yield from served(cfg, d, http=True)


def test_off_unless_allowed(plain_broker):
    c = httpclient.InferenceServerClient(plain_broker.http.removeprefix("http://"))
    try:
        assert not {"system_shared_memory", "cuda_shared_memory"} & set(c.get_server_metadata()["extensions"])
        for call in (lambda: c.register_system_shared_memory("r", "/k", 16), c.get_system_shared_memory_status,
                     c.unregister_system_shared_memory, c.get_cuda_shared_memory_status,
                     lambda: c.register_cuda_shared_memory("g", base64.b64encode(bytes(64)).decode(), 0, 8)):
            refusal(call, "Client shared memory is disabled", "http.allow_client_shm", status="501")
        inputs, outputs = mlp_request("r", np.zeros((1, 256), np.float32))
        refusal(lambda: c.infer("mlp", inputs, outputs=outputs), "off on this face", "http.allow_client_shm",
                status="501")
        inputs, outputs = mlp_request(None, np.zeros((1, 256), np.float32), "r")
        refusal(lambda: c.infer("mlp", inputs, outputs=outputs), "off on this face", status="501")
    finally:
        c.close()
    status, body = post(f"{plain_broker.http}/v2/systemsharedmemory/unregister", None)
    assert (status, body["code"], body["details"]["reason"]) == (501, "INVALID_ARGUMENT", "client_shm_disabled")
