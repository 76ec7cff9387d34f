"""The KServe v2 gRPC face, read by the real tritonclient.grpc (and grpcio's own stubs for health,
reflection and raw metadata): one broker for the module with mlp, fails, spin, a BYTES stage
and a tenant with a tiny rate; the gRPC face on port 0 with client shared memory allowed, and the
HTTP face beside it (the repository extension answers alike on both)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

import stages
from conftest import base_config, in_flight, readme_block, served, wait_until
from tgw.client import Client

TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture(scope="module")
def broker(model_files):
    d = tempfile.mkdtemp(prefix="tgwg-", dir="/tmp")
    os.makedirs(os.path.join(d, "stages"))
    shutil.copy(stages.__file__, os.path.join(d, "stages", "stages.py"))
    cfg = base_config(model_files, "mlp", "fails", "spin", "double", spin={"max_batch_size": 1},
                      fails={"max_batch_size": 4})
    cfg["models"].append(stages.stage_entry("stages/stages.py", "Echo"))
    cfg.update(model_roots=[d, os.path.dirname(model_files["mlp"][0]), os.path.dirname(model_files["spin"][0])],
               grpc={"port": 0, "allow_client_shm": True}, http={"port": 0},
               tenants={"tiny": {"rate": 0.001, "burst": 1}})
    yield from served(cfg, d, http=True, grpc=True)


@pytest.fixture(scope="module")
def triton(broker):
    c = grpcclient.InferenceServerClient(broker.grpc)
    yield c
    c.close()


@pytest.fixture(scope="module")
def native(broker):
    with Client(broker.address) as c:
        yield c


@pytest.fixture(scope="module")
def stub(broker):
    with grpc.insecure_channel(broker.grpc) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


def mlp_input(x: np.ndarray) -> grpcclient.InferInput:
    inp = grpcclient.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return inp


def test_status_shows_the_grpc_address(broker):
    assert broker.grpc.startswith("127.0.0.1:") and int(broker.grpc.rsplit(":", 1)[1]) > 0


def test_infer_and_async_infer_equal_the_native_client(triton, native):
    x = np.random.default_rng(1).standard_normal((4, 256)).astype(np.float32)
    want = native.infer("mlp", {"x": x})["y"]
    got = triton.infer("mlp", [mlp_input(x)], request_id="r1")
    assert got.get_response().id == "r1" and got.get_response().model_version == "1"
    np.testing.assert_array_equal(got.as_numpy("y"), want)
    done = threading.Event()
    box = []
    triton.async_infer("mlp", [mlp_input(x)], lambda result, error: (box.append((result, error)), done.set()))
    assert done.wait(30)
    result, error = box[0]
    assert error is None
    np.testing.assert_array_equal(result.as_numpy("y"), want)


def test_typed_contents_and_bytes(stub, native, triton):
    x = np.arange(512, dtype=np.float32).reshape(2, 256) / 512
    req = service_pb2.ModelInferRequest(model_name="mlp", id="typed")
    t = req.inputs.add(name="x", datatype="FP32", shape=[2, 256])
    t.contents.fp32_contents.extend(x.ravel().tolist())
    resp = stub.ModelInfer(req, timeout=30)
    assert resp.id == "typed" and resp.outputs[0].shape == [2, 10]
    np.testing.assert_array_equal(np.frombuffer(resp.raw_output_contents[0], np.float32).reshape(2, 10),
                                  native.infer("mlp", {"x": x})["y"])
    words = np.array([b"\x00\xffraw", b"", "héllo".encode()], dtype=object)
    inp = grpcclient.InferInput("data", [3], "BYTES")
    inp.set_data_from_numpy(words)   # raw: Triton's 4-byte-length layout
    out = triton.infer("echo", [inp])
    assert out.as_numpy("data").tolist() == words.tolist() and out.as_numpy("length").tolist() == [5, 0, 6]
    req = service_pb2.ModelInferRequest(model_name="echo")
    t = req.inputs.add(name="data", datatype="BYTES", shape=[2])
    t.contents.bytes_contents.extend([b"ab", b"c"])
    resp = stub.ModelInfer(req, timeout=30)
    assert grpcclient.InferResult(resp).as_numpy("data").tolist() == [b"ab", b"c"]


def test_one_stream_of_1000_requests(triton, native):
    x = np.random.default_rng(2).standard_normal((1, 256)).astype(np.float32)
    want = native.infer("mlp", {"x": x})["y"]
    answers, lock, all_in = {}, threading.Lock(), threading.Event()

    def callback(result, error):
        with lock:
            key = result.get_response().id if error is None else f"error:{error.message()}"
            answers[key] = result.as_numpy("y") if error is None else error
            if len(answers) == 1001:
                all_in.set()
    triton.start_stream(callback)
    try:
        for i in range(1000):
            triton.async_stream_infer("mlp", [mlp_input(x)], request_id=str(i))
            if i == 500:   # an error answers that request only; the stream goes on
                triton.async_stream_infer("nope", [mlp_input(x)], request_id="bad")
        assert all_in.wait(60), f"{len(answers)} of 1001 answered"
    finally:
        triton.stop_stream()
    assert {k for k in answers if not k.startswith("error:")} == {str(i) for i in range(1000)}
    # batched with each other: the same rows up to the float rounding a batch's matmul may differ by
    assert all(np.allclose(answers[str(i)], want, rtol=1e-5, atol=1e-6) for i in range(1000))
    errors = [k for k in answers if k.startswith("error:")]
    assert errors == ["error:Request for unknown model: 'nope' is not found"], errors


def test_errors_map_to_status_codes_with_the_tgw_code(triton, stub):
    x = np.zeros((1, 256), np.float32)
    with pytest.raises(InferenceServerException) as err:
        triton.infer("nope", [mlp_input(x)])
    assert err.value.status() == "StatusCode.NOT_FOUND" and \
        err.value.message() == "Request for unknown model: 'nope' is not found"   # Triton's words, no tgw code
    with pytest.raises(InferenceServerException) as err:
        triton.infer("mlp", [mlp_input(np.zeros((1, 7), np.float32))])
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT" and err.value.message().startswith(
        "unexpected shape for input 'x' for model 'mlp'. Expected [-1,256], got [1,7].")
    with pytest.raises(InferenceServerException, match="sequence batching") as err:
        triton.infer("mlp", [mlp_input(x)], sequence_id=7)
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException) as err:   # a model's own failure
        inp = grpcclient.InferInput("x", [1, 2], "FP32")
        inp.set_data_from_numpy(np.array([[-1, 0]], np.float32))
        triton.infer("fails", [inp])
    assert err.value.status() == "StatusCode.INTERNAL" and not err.value.message().startswith("[")
    req = service_pb2.ModelInferRequest(model_name="nope")
    req.inputs.add(name="x", datatype="FP32", shape=[1])
    with pytest.raises(grpc.RpcError) as rpc:
        stub.ModelInfer(req, timeout=30)
    trailers = dict(rpc.value.trailing_metadata())
    assert trailers["tgw-code"] == "MODEL_NOT_FOUND" and trailers["tgw-retryable"] == "false"
    with pytest.raises(InferenceServerException) as err:
        triton.get_trace_settings()
    assert err.value.status() == "StatusCode.UNIMPLEMENTED" and "observability.tracing" in err.value.message()


def test_deadline_and_cancellation(broker, triton, native):
    slow = np.array([[3000]], np.float32)   # thousands of matmuls: a second or more
    with pytest.raises(InferenceServerException) as err:
        triton.infer("spin", [mlp_input(slow)], client_timeout=0.2)
    assert err.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    # one spin computes (max_batch_size 1); a second waits behind it until its client cancels it
    wait_until(lambda: in_flight(native) == 0, what="the timed-out spin done computing")
    blocker = threading.Thread(target=native.infer, args=("spin", {"x": slow}), kwargs={"timeout": 60})
    blocker.start()
    wait_until(lambda: native.stats()["models"]["spin"]["queued"] == 0 and in_flight(native) == 1,
               what="the blocking spin computing")
    before = native.stats()["abandoned"].get("grpc_cancelled", 0)
    call = triton.async_infer("spin", [mlp_input(np.array([[1]], np.float32))], lambda result, error: None)
    wait_until(lambda: native.stats()["models"]["spin"]["queued"] == 1, what="the gRPC request queued")
    call.cancel()
    wait_until(lambda: native.stats()["abandoned"].get("grpc_cancelled", 0) == before + 1,
               what="the cancelled call withdrawn")
    assert native.stats()["models"]["spin"]["queued"] == 0
    # a stream that ends with a request still queued withdraws it too
    req = service_pb2.ModelInferRequest(model_name="spin", id="queued")
    req.inputs.add(name="x", datatype="FP32", shape=[1, 1]).contents.fp32_contents.append(1.0)
    with grpc.insecure_channel(broker.grpc) as channel:
        stream = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter([req]), timeout=60)
        wait_until(lambda: native.stats()["models"]["spin"]["queued"] == 1, what="the stream's request queued")
        stream.cancel()
    wait_until(lambda: native.stats()["abandoned"].get("grpc_cancelled", 0) == before + 2,
               what="the stream's request withdrawn")
    blocker.join(60)


def test_tenant_and_traceparent_metadata(triton, stub):
    x = np.zeros((1, 256), np.float32)
    triton.infer("mlp", [mlp_input(x)], headers={"tgw-tenant": "tiny"})   # its one token
    with pytest.raises(InferenceServerException) as err:
        triton.infer("mlp", [mlp_input(x)], headers={"tgw-tenant": "tiny"})
    assert err.value.status() == "StatusCode.RESOURCE_EXHAUSTED" and "tiny" in err.value.message()
    req = service_pb2.ModelInferRequest(model_name="mlp")
    t = req.inputs.add(name="x", datatype="FP32", shape=[1, 256])
    t.contents.fp32_contents.extend([0.0] * 256)
    _, call = stub.ModelInfer.with_call(req, timeout=30, metadata=(("traceparent", TRACE),))
    trace = dict(call.trailing_metadata())["traceparent"]
    assert trace.split("-")[1] == TRACE.split("-")[1]   # the caller's trace, continued


def test_config_statistics_metadata_and_repository(triton):
    assert triton.is_server_live() and triton.is_server_ready() and triton.is_model_ready("mlp")
    meta = triton.get_server_metadata()
    assert meta.name == "triton" and {"statistics", "model_repository", "system_shared_memory"} <= set(meta.extensions)
    model = triton.get_model_metadata("mlp")
    assert model.inputs[0].name == "x" and model.inputs[0].datatype == "FP32" and list(model.inputs[0].shape) == [-1, 256]
    cfg = triton.get_model_config("mlp").config
    assert cfg.name == "mlp" and cfg.max_batch_size == 64 and cfg.input[0].dims == [256]
    assert grpcclient.model_config_pb2.DataType.Name(cfg.input[0].data_type) == "TYPE_FP32"
    assert triton.get_model_config("mlp", as_json=True)["config"]["output"][0]["dims"] == ["10"]
    triton.infer("mlp", [mlp_input(np.zeros((2, 256), np.float32))])
    stats = triton.get_inference_statistics("mlp").model_stats[0]
    assert stats.name == "mlp" and stats.version == "1" and stats.inference_stats.success.count >= 1
    assert stats.inference_stats.success.ns > 0 and stats.execution_count >= 1
    every = {s.name for s in triton.get_inference_statistics().model_stats}
    assert {"mlp", "spin", "echo"} <= every
    index = {(m.name, m.version): m.state for m in triton.get_model_repository_index().models}
    assert index[("mlp", "1")] == "READY"
    triton.unload_model("double")
    wait_until(lambda: not triton.is_model_ready("double"), what="double unloaded")
    triton.load_model("double")
    assert triton.is_model_ready("double")
    with pytest.raises(InferenceServerException, match="failed to load 'double', a load with a config override"):
        triton.load_model("double", config='{"max_batch_size": 4}')


def test_health_probe_and_reflection(broker):
    with grpc.insecure_channel(broker.grpc) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "inference.GRPCInferenceService", "mlp"):
            answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING, service
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                            timeout=10)
        names = {s.name for s in next(answers).list_services_response.service}
        assert {"inference.GRPCInferenceService", "grpc.health.v1.Health"} <= names


def test_doc_example_runs_as_printed(broker):
    port = broker.grpc.rsplit(":", 1)[1]
    code = readme_block("grpc-example:python").replace(":8001", f":{port}")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "(4, 10)"


def test_system_shared_memory_inputs_and_outputs(triton, native):
    import tritonclient.utils.shared_memory as shm
    x = np.random.default_rng(3).standard_normal((2, 256)).astype(np.float32)
    key = f"/tgwg-test-{os.getpid()}"
    handle = shm.create_shared_memory_region("grpc_io", key, x.nbytes + 80)
    try:
        shm.set_shared_memory_region(handle, [x])
        triton.register_system_shared_memory("grpc_io", key, x.nbytes + 80)
        assert triton.get_system_shared_memory_status().regions["grpc_io"].byte_size == x.nbytes + 80
        inp = grpcclient.InferInput("x", [2, 256], "FP32")
        inp.set_shared_memory("grpc_io", x.nbytes)
        out = grpcclient.InferRequestedOutput("y")
        out.set_shared_memory("grpc_io", 80, offset=x.nbytes)
        result = triton.infer("mlp", [inp], outputs=[out])
        assert result.get_output("y").parameters["shared_memory_region"].string_param == "grpc_io"
        got = shm.get_contents_as_numpy(handle, np.float32, [2, 10], offset=x.nbytes)
        np.testing.assert_array_equal(got, native.infer("mlp", {"x": x})["y"])
    finally:
        triton.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(handle)
    assert not triton.get_system_shared_memory_status().regions


def test_repository_answers_alike_over_http_and_grpc(broker, triton):
    import tritonclient.http as httpclient
    web = httpclient.InferenceServerClient(broker.http.removeprefix("http://"))
    try:
        over_http = sorted((m["name"], m["version"], m["state"]) for m in web.get_model_repository_index())
        over_grpc = sorted((m.name, m.version, m.state) for m in triton.get_model_repository_index().models)
        assert over_http == over_grpc and ("echo", "1", "READY") in over_grpc
        web.unload_model("double")
        wait_until(lambda: not triton.is_model_ready("double"), what="double unloaded over HTTP")
        triton.load_model("double")
        assert web.is_model_ready("double")
    finally:
        web.close()
