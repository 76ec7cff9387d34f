"""The HTTP face end to end: a real broker, driven by the real tritonclient.http and by curl.

Every answer is checked against the native socket's answer for the same inputs (the same
workers compute both, so they must be equal to the bit)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import sys
import threading
import urllib.request

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import base_config, in_flight, readme_block, served, wait_until
from tgw.client import Client

CURL = shutil.which("curl")


@pytest.fixture(scope="module")
def http_broker(model_files):
    d = tempfile.mkdtemp(prefix="tgwh-", dir="/tmp")
    cfg = base_config(model_files, "mlp", "embed", "mixed", "spin", mlp={"priority_levels": 2},
                      spin={"max_batch_size": 1})
    cfg.update(http={"port": 0, "max_body_bytes": 1 << 20}, tenants={"tiny": {"rate": 0.001, "burst": 1}})
    yield from served(cfg, d, http=True)


@pytest.fixture(scope="module")
def triton(http_broker):
    c = httpclient.InferenceServerClient(http_broker.http.removeprefix("http://"))
    yield c
    c.close()


@pytest.fixture(scope="module")
def native(http_broker):
    with Client(http_broker.address) as c:
        yield c


def post(url: str, body: bytes, headers: dict | None = None) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, data=body, headers=headers or {}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def refused(http_broker, model: str, doc: dict, status: int, code: str) -> str:
    got, _, body = post(f"{http_broker.http}/v2/models/{model}/infer", json.dumps(doc).encode())
    answer = json.loads(body)
    assert (got, answer["code"]) == (status, code), answer
    return answer["error"]


def test_health_and_metadata_through_tritonclient(triton):
    assert triton.is_server_live() and triton.is_server_ready()
    assert triton.is_model_ready("mlp") and triton.is_model_ready("mlp", "1")
    assert not triton.is_model_ready("mlp", "7") and not triton.is_model_ready("nope")
    meta = triton.get_model_metadata("mlp")
    assert meta["name"] == "mlp" and meta["versions"] == ["1"] and meta["platform"] == "pytorch_libtorch"
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 256]}]
    assert meta["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [-1, 10]}]
    assert triton.get_server_metadata()["extensions"] == ["classification", "binary_tensor_data", "model_repository",
                                                          "metrics", "statistics", "sequence", "generate"]
    with pytest.raises(InferenceServerException, match="Request for unknown model: 'nope' is not found"):
        triton.get_model_metadata("nope")


@pytest.mark.parametrize("binary_in,binary_out", [(False, False), (True, True), (True, False), (False, True)])
def test_infer_json_and_binary_equals_native(triton, native, binary_in, binary_out):
    x = np.random.default_rng(7).standard_normal((3, 256), dtype=np.float32)
    inp = httpclient.InferInput("x", [3, 256], "FP32")
    inp.set_data_from_numpy(x, binary_data=binary_in)
    result = triton.infer("mlp", [inp], outputs=[httpclient.InferRequestedOutput("y", binary_data=binary_out)],
                          request_id="r-42")
    assert result.get_response()["id"] == "r-42" and result.get_response()["model_version"] == "1"
    np.testing.assert_array_equal(result.as_numpy("y"), native.infer("mlp", {"x": x})["y"])


def test_every_carried_datatype_round_trips(triton, native):
    """float16, bool and int64 in and out (the `mixed` model), JSON and binary."""
    a = np.arange(8, dtype=np.float16).reshape(2, 4) / 4
    b = np.array([[True, False, True], [False, False, True]])
    c = np.arange(10, dtype=np.int64).reshape(2, 5) - 3
    want = native.infer("mixed", {"a": a, "b": b, "c": c})
    for binary in (False, True):
        inputs = []
        for name, arr, dt in (("a", a, "FP16"), ("b", b, "BOOL"), ("c", c, "INT64")):
            inputs.append(httpclient.InferInput(name, list(arr.shape), dt))
            inputs[-1].set_data_from_numpy(arr, binary_data=binary)
        outs = [httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("a2", "nb", "csum")]
        got = triton.infer("mixed", inputs, outputs=outs)
        for name in ("a2", "nb", "csum"):
            np.testing.assert_array_equal(got.as_numpy(name), want[name])


def test_compressed_request_and_reply(triton, native):
    x = np.ones((2, 256), dtype=np.float32)
    inp = httpclient.InferInput("x", [2, 256], "FP32")
    inp.set_data_from_numpy(x)
    got = triton.infer("mlp", [inp], request_compression_algorithm="gzip", response_compression_algorithm="gzip")
    np.testing.assert_array_equal(got.as_numpy("y"), native.infer("mlp", {"x": x})["y"])


@pytest.mark.skipif(CURL is None, reason="curl is not installed")
def test_curl_json_and_binary(http_broker, native, tmp_path):
    body = {"inputs": [{"name": "tokens", "shape": [1, 4], "datatype": "INT64", "data": [1, 2, 3, 4]}]}
    out = subprocess.run([CURL, "-s", "-X", "POST", f"{http_broker.http}/v2/models/embed/infer",
                          "-H", "Content-Type: application/json", "-d", json.dumps(body)],
                         capture_output=True, check=True, timeout=30).stdout
    reply = json.loads(out)
    want = native.infer("embed", {"tokens": np.array([[1, 2, 3, 4]], dtype=np.int64)})
    got = {o["name"]: np.array(o["data"], dtype=np.float32 if o["datatype"] == "FP32" else np.int64)
           for o in reply["outputs"]}
    np.testing.assert_array_equal(got["embedding"], want["embedding"].reshape(-1))
    np.testing.assert_array_equal(got["length"], want["length"])
    # the binary extension: a JSON header, then the raw bytes; binary outputs back
    x = np.arange(256, dtype=np.float32).reshape(1, 256) / 256
    header = json.dumps({"inputs": [{"name": "x", "shape": [1, 256], "datatype": "FP32",
                                     "parameters": {"binary_data_size": x.nbytes}}],
                         "parameters": {"binary_data_output": True}}).encode()
    (tmp_path / "body.bin").write_bytes(header + x.tobytes())
    proc = subprocess.run([CURL, "-s", "-D", str(tmp_path / "headers"), "-X", "POST",
                           f"{http_broker.http}/v2/models/mlp/infer", "-H", f"Inference-Header-Content-Length: "
                           f"{len(header)}", "--data-binary", f"@{tmp_path / 'body.bin'}"],
                          capture_output=True, check=True, timeout=30)
    headers = (tmp_path / "headers").read_text().lower()
    n = int(headers.split("inference-header-content-length:")[1].split()[0])
    meta = json.loads(proc.stdout[:n])
    assert meta["outputs"][0]["parameters"]["binary_data_size"] == 40
    np.testing.assert_array_equal(np.frombuffer(proc.stdout[n:], dtype=np.float32),
                                  native.infer("mlp", {"x": x})["y"].reshape(-1))


BAD_BODIES = [  # (model, body, HTTP status, code, words in the message)
    ("mlp", {"inputs": [{"name": "x", "shape": [1, 256], "datatype": "BF16", "data": [0] * 256}]}, 400,
     "INVALID_INPUT_DTYPE", "data-type is 'BF16', but model 'mlp' expects 'FP32'"),
    ("mlp", {"inputs": [{"name": "x", "shape": [1], "datatype": "BYTES", "data": ["a"]}]}, 400,
     "INVALID_INPUT_DTYPE", "data-type is 'BYTES'"),
    ("mlp", {"inputs": [{"name": "x", "shape": [1, 256], "datatype": "FP32", "data": [1.0]}]}, 400,
     "INVALID_INPUT_SHAPE", "Failed to parse 'data' field: shape does not match true shape"),
    ("mlp", {"inputs": [{"name": "x", "shape": [1, 256], "datatype": "INT32", "data": [0] * 256}]}, 400,
     "INVALID_INPUT_DTYPE", "expects 'FP32'"),
    ("embed", {"inputs": [{"name": "tokens", "shape": [1, 2], "datatype": "INT64", "data": [1.5, 2]}]}, 400,
     "INVALID_INPUT_DTYPE", "must be integers"),
    ("embed", {"inputs": [{"name": "tokens", "shape": [1, 2], "datatype": "UINT8", "data": [300, 2]}]}, 400,
     "INVALID_ARGUMENT", "out of the range of UINT8"),
    ("mlp", {"inputs": [{"name": "x", "shape": [1, 256], "datatype": "FP32", "data": [0] * 256}],
             "parameters": {"sequence_id": 3}}, 400, "INVALID_ARGUMENT", "sequence batching"),
    ("mlp", {"inputs": [{"name": "x", "shape": [1, 256], "datatype": "FP32", "data": [0] * 256}],
             "parameters": {"priority": 2}}, 400, "INVALID_ARGUMENT", "levels 0..1"),
    ("mlp", {"inputs": []}, 400, "INVALID_ARGUMENT", "missing required input(s) ['x']"),
    ("nope", {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [0]}]}, 404,
     "MODEL_NOT_FOUND", "nope"),
]


@pytest.mark.parametrize("model,doc,status,code,words", BAD_BODIES, ids=[b[4] for b in BAD_BODIES])
def test_bad_requests_get_the_codes_status_and_a_clear_message(http_broker, model, doc, status, code, words):
    assert words in refused(http_broker, model, doc, status, code)


def test_malformed_bodies_and_limits(http_broker):
    url = f"{http_broker.http}/v2/models/mlp/infer"
    header = json.dumps({"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32",
                                     "parameters": {"binary_data_size": 4}}]}).encode()
    for body, headers, words in ((b"garbage", {}, "not JSON"),
                                 (b'{"inputs": []}', {"Inference-Header-Content-Length": "999"}, "body holds"),
                                 (header + bytes(5), {"Inference-Header-Content-Length": str(len(header))},
                                  "follow the last binary input"),
                                 (header + bytes(3), {"Inference-Header-Content-Length": str(len(header))},
                                  "does not fit")):
        status, _, answer = post(url, body, headers)
        assert status == 400 and words in json.loads(answer)["error"], answer
    status, _, answer = post(url, b"{" + b" " * (1 << 20) + b"}")
    assert (status, json.loads(answer)["code"]) == (413, "PAYLOAD_TOO_LARGE")
    status, _, answer = post(f"{http_broker.http}/v2/nothing", b"")
    assert status == 404 and json.loads(answer)["error"]


def test_tenant_header_and_timeout_parameter_mean_what_they_mean_natively(http_broker, native):
    x = {"inputs": [{"name": "x", "shape": [1, 256], "datatype": "FP32", "data": [0] * 256}]}
    url = f"{http_broker.http}/v2/models/mlp/infer"
    assert post(url, json.dumps(x).encode(), {"tgw-tenant": "tiny"})[0] == 200   # its one token
    status, _, answer = post(url, json.dumps(x).encode(), {"tgw-tenant": "tiny"})
    assert (status, json.loads(answer)["code"]) == (429, "RATE_LIMITED")
    # a long spin holds the one worker; a request allowed 1 ms behind it cannot be answered in time
    hold = threading.Thread(target=native.infer, args=("spin", {"x": np.full((1, 1), 1500, np.float32)}),
                            kwargs={"timeout": 120})
    hold.start()
    try:
        wait_until(lambda: in_flight(native) >= 1, what="the spin computing")
        doc = {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [1]}],
               "parameters": {"timeout": 1000}}
        refused(http_broker, "spin", doc, 504, "DEADLINE_EXCEEDED")
    finally:
        hold.join(120)


def test_many_concurrent_requests_all_answered_right(http_broker, native):
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((1 + i % 4, 256), dtype=np.float32) for i in range(16)]
    want = [native.infer("mlp", {"x": x})["y"] for x in xs]
    errors: list = []

    def caller(k: int) -> None:
        c = httpclient.InferenceServerClient(http_broker.http.removeprefix("http://"))
        try:
            for j in range(25):
                i = (k + j) % len(xs)
                inp = httpclient.InferInput("x", list(xs[i].shape), "FP32")
                inp.set_data_from_numpy(xs[i])
                got = c.infer("mlp", [inp]).as_numpy("y")
                # batched with others, a row may differ from computing it alone in the last bits
                if got.shape != want[i].shape or not np.allclose(got, want[i], rtol=1e-5, atol=1e-6):
                    errors.append(("mismatch", k, j, float(np.abs(got - want[i]).max())))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            c.close()
    threads = [threading.Thread(target=caller, args=(k,)) for k in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []


def test_repository_index_load_and_unload(http_broker, triton, model_files, native):
    index = {(m["name"], m["version"]): m["state"] for m in triton.get_model_repository_index()}
    assert index[("mlp", "1")] == "READY"
    url = f"{http_broker.http}/v2/repository/models/embed"
    status, _, answer = post(url + "/load", json.dumps({"parameters": {"bogus": 1}}).encode())
    assert status == 400 and "unknown parameter 'bogus'" in json.loads(answer)["error"]
    # a second version of embed (the same file), as a canary beside version 1
    embed_path = model_files["embed"][0]
    status, _, answer = post(url + "/load", json.dumps({"parameters": {"version": "2", "path": embed_path,
                                                                       "weight": 1}}).encode())
    assert status == 200, answer
    assert triton.is_model_ready("embed", "2")
    triton.unload_model("embed")   # every version
    assert not triton.is_model_ready("embed")
    assert refused(http_broker, "embed", {"inputs": [   # Triton's words and status; tgw's code beside
        {"name": "tokens", "shape": [1, 1], "datatype": "INT64", "data": [1]}]}, 404, "MODEL_NOT_READY") == \
        "Request for unknown model: 'embed' has no available versions"
    triton.load_model("embed")     # no version named: the config's
    assert triton.is_model_ready("embed", "1") and not triton.is_model_ready("embed", "2")
    triton.load_model("embed")     # already loaded: nothing to do
    tokens = np.array([[5, 6]], dtype=np.int64)
    assert native.infer("embed", {"tokens": tokens})["length"].tolist() == [2]


def test_status_shows_the_http_address(http_broker, native):
    assert native.status()["http"] == http_broker.http and http_broker.http.startswith("http://127.0.0.1:")


def test_token_guards_everything_but_health(make_broker, model_files, short_dir, monkeypatch):
    token_file = os.path.join(short_dir, "token")
    with open(token_file, "w") as f:
        f.write("s3cret-token-value\n")
    os.chmod(token_file, 0o600)
    cfg = base_config(model_files, "mlp", server={"auth_token_file": token_file})
    cfg["http"] = {"port": 0}
    monkeypatch.setenv("TGW_TOKEN", "s3cret-token-value")   # the native client's, to see it ready
    b = make_broker(cfg)
    with Client(b.address) as c:
        url = c.status()["http"]
    assert urllib.request.urlopen(f"{url}/v2/health/ready", timeout=10).status == 200
    status, _, answer = post(f"{url}/v2/repository/index", b"")
    assert (status, json.loads(answer)["code"]) == (401, "UNAUTHENTICATED")
    triton = httpclient.InferenceServerClient(url.removeprefix("http://"))
    try:
        with pytest.raises(InferenceServerException, match="Authorization: Bearer"):
            triton.get_model_metadata("mlp")
        meta = triton.get_model_metadata("mlp", headers={"Authorization": "Bearer s3cret-token-value"})
        assert meta["name"] == "mlp"
    finally:
        triton.close()


def readme_example(kind: str) -> str:
    return readme_block(f"http-example:{kind}")


def test_readme_examples_work_as_printed(http_broker, native):
    """The README's tritonclient and curl examples, run unchanged but for the port."""
    port = http_broker.http.rsplit(":", 1)[1]
    code = readme_example("python").replace(":8000", f":{port}")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "(4, 10)"
    if CURL is None:
        pytest.skip("curl is not installed")
    script = readme_example("curl").replace(":8000", f":{port}")
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and lines[0] == "200", out
    assert json.loads(lines[1])["name"] == "embed"
    assert json.loads(lines[2])["outputs"][0]["name"] == "embedding"
    assert json.loads(lines[3])["code"] == "MODEL_NOT_FOUND"
    assert any(line.startswith("tgw_requests_total{") for line in lines[4:]), lines[4:]


def test_traceparent_is_carried_back(http_broker):
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    doc = {"inputs": [{"name": "x", "shape": [1, 256], "datatype": "FP32", "data": [0] * 256}]}
    status, headers, _ = post(f"{http_broker.http}/v2/models/mlp/infer", json.dumps(doc).encode(),
                              {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
    assert status == 200 and headers["traceparent"].split("-")[1] == trace_id


def test_stop_answers_the_http_requests_in_flight(make_broker, model_files):
    """SIGTERM with an HTTP request computing: it is answered, then the broker exits 0. (And
    http.max_inflight: while it computes, a second HTTP request is one too many.)"""
    cfg = base_config(model_files, "spin", spin={"max_batch_size": 1})
    cfg["http"] = {"port": 0, "max_inflight": 1}
    b = make_broker(cfg)
    with Client(b.address) as c:
        url = c.status()["http"]
        doc = {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [300]}]}
        answer: list = []
        t = threading.Thread(target=lambda: answer.append(post(f"{url}/v2/models/spin/infer",
                                                               json.dumps(doc).encode())))
        t.start()
        wait_until(lambda: in_flight(c) >= 1, what="the HTTP request computing")
        status, _, body = post(f"{url}/v2/models/spin/infer", json.dumps(doc).encode())
        assert (status, json.loads(body)["details"]["reason"]) == (429, "http_inflight")
        b.proc.send_signal(15)
        t.join(60)
    assert answer and answer[0][0] == 200, answer
    assert json.loads(answer[0][2])["outputs"][0]["data"] == [301.0]
    assert b.stop() == 0


def test_port_flags_turn_the_faces_on_and_survive_a_reload(make_broker, model_files):
    import tritonclient.grpc as grpcclient
    cfg = base_config(model_files, "mlp")                  # no http or grpc section: off unless asked
    b = make_broker(cfg, start=False).start(args=("--http-port", "0", "--grpc-port", "0"))
    with Client(b.address) as c:
        url, grpc_address = c.status()["http"], c.status()["grpc"]
    assert urllib.request.urlopen(f"{url}/v2/health/live", timeout=10).status == 200
    with grpcclient.InferenceServerClient(grpc_address) as g:
        assert g.is_server_live() and g.get_model_metadata("mlp").name == "mlp"
    reload = [sys.executable, "-m", "tgw.broker", "reload", "--address", b.address, "--json"]
    out = subprocess.run(reload, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "no changes" in json.loads(out.stdout)["message"], out
    with open(b.config_path) as f:
        text = f.read()
    with open(b.config_path, "w") as f:                    # a change to http itself needs a restart
        f.write(text + "\nhttp: {port: 0, max_inflight: 7}\n")
    out = subprocess.run(reload, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "need a restart: http" in out.stderr, out


def test_metrics_scraped_over_http_count_http_requests(http_broker):
    """/metrics on the HTTP port, parsed: HTTP requests are counted as native ones are."""
    from prometheus_client.parser import text_string_to_metric_families

    def requests_total(**labels) -> float:
        with urllib.request.urlopen(f"{http_broker.http}/metrics", timeout=10) as r:
            assert r.headers["Content-Type"].startswith("text/plain")
            fams = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
        return sum(s.value for s in fams["tgw_requests"].samples
                   if s.name == "tgw_requests_total" and all(s.labels.get(k) == v for k, v in labels.items()))
    ok, bad = requests_total(model="mlp", version="1", code="OK"), requests_total(model="mlp", code="INVALID_INPUT_SHAPE")
    doc = {"inputs": [{"name": "x", "shape": [1, 256], "datatype": "FP32", "data": [0] * 256}]}
    for _ in range(3):
        assert post(f"{http_broker.http}/v2/models/mlp/infer", json.dumps(doc).encode())[0] == 200
    doc["inputs"][0]["shape"] = [1, 255]
    refused(http_broker, "mlp", doc, 400, "INVALID_INPUT_SHAPE")
    assert requests_total(model="mlp", version="1", code="OK") == ok + 3
    assert requests_total(model="mlp", code="INVALID_INPUT_SHAPE") == bad + 1
