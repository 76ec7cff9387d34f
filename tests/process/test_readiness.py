"""Readiness a balancer can trust, load reports and the routing-key header (issue 26 items 1, 2).

One broker for the module (one CPU worker; HTTP and gRPC faces): mlp as a 50/50 canary of two
versions, spin (slow, one row a batch) and fails with a breaker that opens after three errors.
Its tests read the load report on every HTTP answer and gRPC call, watch the queue depth rise
behind spin, follow routing keys given as a header, and see readiness drop and come back while
the breaker cools down. Two brokers of their own then take
SIGTERM with server.drain_notice_s: not ready at once while every request is still served, and
exit 0 after the notice and the drain (or at once with a second signal); the second also loses
its only worker first, not ready until the restarted one serves."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from conftest import base_config, readme_block, served, wait_until
from tgw.broker.observe.load import HEADER, NAMED, TOP, parse
from tgw.client import Client

MLP_ROW = {"name": "x", "shape": [1, 256], "datatype": "FP32", "data": [0.0] * 256}
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def broker(model_files):
    d = tempfile.mkdtemp(prefix="tgwr-", dir="/tmp")
    path = model_files["mlp"][0]
    cfg = base_config(model_files, "mlp", "spin", "fails", spin={"max_batch_size": 1},
                      mlp={"versions": [{"version": "1", "path": path, "weight": 50},
                                        {"version": "2", "path": path, "weight": 50}]},
                      fails={"max_batch_size": 1, "breaker": {"min_requests": 3, "error_rate": 0.5,
                                                              "cooldown_s": 4}})
    cfg.update(http={"port": 0}, grpc={"port": 0})
    yield from served(cfg, d, http=True, grpc=True)


def get(url: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, data=body, headers=headers or {}, method="POST" if body else "GET")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def infer_doc(**params) -> bytes:
    return json.dumps({"inputs": [MLP_ROW], **({"parameters": params} if params else {})}).encode()


def load_of(headers: dict) -> dict:
    """The endpoint-load-metrics header, parsed as Envoy reads ORCA's text form, with every figure."""
    figures = parse(headers[HEADER])
    assert set(figures) == {*TOP, *(f"named_metrics.{k}" for k in NAMED)}, figures
    assert figures["mem_utilization"] <= 1 and figures["named_metrics.memory_headroom"] <= 1
    return figures


def ready_code(b) -> int:
    return get(f"{b.http}/v2/health/ready")[0]


def grpc_health(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status


def all_ready(b) -> None:
    wait_until(lambda: ready_code(b) == 200, 60, "the broker ready")


def test_every_http_answer_carries_the_load_report_and_v2_load_is_its_twin(broker):
    all_ready(broker)
    url = broker.http
    answers = [get(f"{url}{p}") for p in ("/v2/health/live", "/v2/health/ready", "/v2", "/v2/models/mlp",
                                          "/metrics", "/v2/models/stats", "/no/such/path")]
    answers += [get(f"{url}/v2/models/mlp/infer", infer_doc()), get(f"{url}/v2/models/nope/infer", infer_doc())]
    assert [a[0] for a in answers] == [200, 200, 200, 200, 200, 200, 404, 200, 404]
    for _, headers, _ in answers:
        load_of(headers)
    status, headers, body = get(f"{url}/v2/load")
    doc = json.loads(body)
    figures = load_of(headers)   # the same refresh as the body: equal to the last digit
    assert status == 200 and {k: doc[k] for k in TOP} == {k: figures[k] for k in TOP}
    assert {f"named_metrics.{k}": v for k, v in doc["named_metrics"].items()} == \
        {k: v for k, v in figures.items() if k.startswith("named_metrics.")}
    assert doc["phase"] == "serving" and doc["models"]["mlp"]["slo_key"] == "timeout_ms"


def test_the_docs_load_example_runs_as_printed(broker):
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    script = readme_block("load-example:curl").replace(":8000", f":{broker.http.rsplit(':', 1)[1]}")
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    head, _, body = out.stdout.partition("\n\n")   # text mode: curl's CRLFs read as newlines
    assert out.returncode == 0 and head.startswith("HTTP/1.1 200"), out
    line = next(h for h in head.splitlines() if h.lower().startswith(HEADER + ":"))
    assert parse(line.split(":", 1)[1].strip()) and json.loads(body)["phase"] == "serving"


def test_grpc_calls_carry_the_load_report_in_trailing_metadata(broker):
    with grpc.insecure_channel(broker.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        req = service_pb2.ModelInferRequest(model_name="mlp")
        req.inputs.add(name="x", datatype="FP32", shape=[1, 256])
        req.raw_input_contents.append(np.zeros((1, 256), np.float32).tobytes())
        _, call = stub.ModelInfer.with_call(req, timeout=30)
        load_of(dict(call.trailing_metadata()))
        _, call = stub.ServerReady.with_call(service_pb2.ServerReadyRequest(), timeout=30)
        load_of(dict(call.trailing_metadata()))
        req.model_name = "nope"
        with pytest.raises(grpc.RpcError) as err:   # an error keeps its own trailers beside the report
            stub.ModelInfer(req, timeout=30)
        trailers = dict(err.value.trailing_metadata())
        assert trailers["tgw-code"] == "MODEL_NOT_FOUND"
        load_of(trailers)


def test_queue_depth_rises_behind_a_slow_model(broker):
    results: list = []

    def call() -> None:
        with Client(broker.address) as c:   # hundreds of matmuls each, one request a batch
            results.append(c.infer("spin", {"x": np.array([[400]], np.float32)}, timeout=60))
    callers = [threading.Thread(target=call) for _ in range(5)]
    for t in callers:
        t.start()

    def load() -> dict:
        return json.loads(get(f"{broker.http}/v2/load")[2])
    try:
        # one computing and one staged on the worker: the others wait in the queue
        seen = wait_until(lambda: (d := load())["named_metrics"]["queue_depth"] >= 1 and d, 30, "a queue behind spin")
        assert seen["named_metrics"]["inflight"] >= seen["named_metrics"]["queue_depth"] + 1
        assert seen["models"]["spin"]["queued"] >= 1
        wait_until(lambda: load()["application_utilization"] > 0, 30, "the worker's busy share")
    finally:
        for t in callers:
            t.join(120)
    assert len(results) == 5
    wait_until(lambda: load()["models"]["spin"]["p99_over_slo"] > 0, 30, "spin's p99 against its timeout")
    wait_until(lambda: (d := load())["named_metrics"]["queue_depth"] == 0 and d["named_metrics"]["inflight"] == 0,
               30, "the queue empty again")


def grpc_version(stub, key: str, metadata: tuple = ()) -> str:
    req = service_pb2.ModelInferRequest(model_name="mlp")
    req.inputs.add(name="x", datatype="FP32", shape=[1, 256])
    req.raw_input_contents.append(np.zeros((1, 256), np.float32).tobytes())
    if key:
        req.parameters["routing_key"].string_param = key
    return stub.ModelInfer(req, timeout=30, metadata=metadata).model_version


def test_the_routing_key_header_reaches_the_canary_split(broker):
    url = f"{broker.http}/v2/models/mlp/infer"

    def version(doc: bytes, headers: dict | None = None) -> str:
        status, _, body = get(url, doc, headers)
        assert status == 200, body
        return json.loads(body)["model_version"]
    keys = [f"user-{k}" for k in range(16)]
    by_param = {k: version(infer_doc(routing_key=k)) for k in keys}
    assert set(by_param.values()) == {"1", "2"}   # 16 keys over a 50/50 split: both versions
    for k in keys:   # the header, twice, and both at once: the parameter's version every time
        assert version(infer_doc(), {"tgw-routing-key": k}) == by_param[k]
        assert version(infer_doc(routing_key=k), {"tgw-routing-key": k}) == by_param[k]
    status, _, body = get(url, infer_doc(routing_key="a"), {"tgw-routing-key": "b"})
    assert status == 400 and json.loads(body)["code"] == "INVALID_ARGUMENT" and "differ" in json.loads(body)["error"]
    with grpc.insecure_channel(broker.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for k in keys[:6]:
            assert grpc_version(stub, "", (("tgw-routing-key", k),)) == by_param[k]
        with pytest.raises(grpc.RpcError) as err:
            grpc_version(stub, "a", (("tgw-routing-key", "b"),))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_not_ready_while_a_breaker_is_open_then_ready_after_its_cooldown(broker):
    all_ready(broker)
    bad = json.dumps({"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [-1.0, 0.0]}]}).encode()
    for _ in range(3):   # min_requests errors: the breaker opens (cooldown 4 s)
        assert get(f"{broker.http}/v2/models/fails/infer", bad)[0] == 500
    with Client(broker.address) as c:
        assert c.stats()["models"]["fails"]["breakers"]["1"]["state"] == "open"
        health = c.health()
        assert health["ready"] is False and health["models"]["fails"] is False and health["models"]["mlp"] is True
    assert ready_code(broker) == 400
    wait_until(lambda: ready_code(broker) == 200, 30, "ready again once the cooldown is over")
    assert grpc_health(broker.grpc) == SERVING


# ---- SIGTERM with a drain notice -------------------------------------------------------------

def notice_broker(model_files, make_broker, short_dir, notice_s: float, env: dict | None = None):
    cfg = base_config(model_files, "mlp", server={"drain_notice_s": notice_s})
    cfg.update(http={"port": 0}, grpc={"port": 0})
    b = make_broker(cfg, start=False).start(env=env)
    with Client(b.address) as c:
        st = c.status()
    b.http, b.grpc = st["http"], st["grpc"]
    return b


def test_sigterm_notice_reports_not_ready_while_serving_and_a_second_signal_drains(model_files, make_broker,
                                                                                   short_dir):
    path = os.path.join(short_dir, "notify")
    sd = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sd.bind(path)
    sd.settimeout(30)
    try:
        b = notice_broker(model_files, make_broker, short_dir, 600.0, env={"NOTIFY_SOCKET": path})
        native = Client(b.address)
        assert ready_code(b) == 200 and grpc_health(b.grpc) == SERVING
        os.kill(b.pid, signal.SIGTERM)
        wait_until(lambda: ready_code(b) == 400, 30, "not ready at the first SIGTERM")
        assert grpc_health(b.grpc) == NOT_SERVING and native.health()["ready"] is False
        for _ in range(5):   # still served, over every face, and each HTTP answer closes its connection
            status, headers, _ = get(f"{b.http}/v2/models/mlp/infer", infer_doc())
            assert status == 200 and headers.get("Connection") == "close"
            assert native.infer("mlp", {"x": np.zeros((1, 256), np.float32)})["y"].shape == (1, 10)
        assert native.status()["phase"] == "draining"   # so all of the above was answered in the notice
        assert json.loads(get(f"{b.http}/v2/load")[2])["phase"] == "draining"
        seen = [sd.recv(4096).decode()]
        while "STOPPING=1" not in seen[-1]:
            seen.append(sd.recv(4096).decode())
        native.close()
        os.kill(b.pid, signal.SIGTERM)   # a second signal ends the 600 s notice: drain and exit
        assert b.proc.wait(60) == 0
    finally:
        sd.close()
    assert "ending the drain notice" in b.output()


def test_not_ready_while_the_only_worker_restarts_and_a_notice_that_runs_out(model_files, make_broker, short_dir):
    b = notice_broker(model_files, make_broker, short_dir, 3.0)
    with Client(b.address) as c:
        pid = next(p["pid"] for p in c.stats()["processes"] if p["role"] == "worker")
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: ready_code(b) == 400, 30, "not ready once the worker is gone")
    wait_until(lambda: grpc_health(b.grpc) == SERVING, 60, "ready again after the restart")
    assert ready_code(b) == 200
    assert get(f"{b.http}/v2/models/mlp/infer", infer_doc())[0] == 200
    os.kill(b.pid, signal.SIGTERM)   # then the notice runs its 3 s, the drain follows, exit 0
    assert b.proc.wait(60) == 0
    out = b.output()
    assert "drain notice: reporting not ready for 3 s" in out and "second stop signal" not in out
