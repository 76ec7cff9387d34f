"""The HTTP and gRPC faces served by front processes (server.front_processes, docs/FRONTS.md).

Two checks: a broker with two fronts serves both faces through them (the processes named, the
inference done in them, their figures in status; supervision is test_fronts.py's), and the
existing face tests pass unchanged with
TGW_TEST_FRONTS=2 (tests/conftest.py gives every broker they start two fronts): a chosen
subset in the default run, every face test module with TGW_SLOW=1.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from conftest import base_config, served, wait_until
from tgw.client import Client

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(HERE)
SLOW = os.environ.get("TGW_SLOW") == "1"

# the default run: each concern of the list once (infer JSON and binary, gRPC unary and
# stream, errors, the token, tenants, deadlines, routing keys, cancellation, tracing headers)
SHORT = [
    "tests/process/test_http.py::test_infer_json_and_binary_equals_native",
    "tests/process/test_http.py::test_bad_requests_get_the_codes_status_and_a_clear_message",
    "tests/process/test_http.py::test_malformed_bodies_and_limits",
    "tests/process/test_http.py::test_tenant_header_and_timeout_parameter_mean_what_they_mean_natively",
    "tests/process/test_http.py::test_traceparent_is_carried_back",
    "tests/process/test_http.py::test_token_guards_everything_but_health",
    "tests/process/test_grpc.py::test_infer_and_async_infer_equal_the_native_client",
    "tests/process/test_grpc.py::test_one_stream_of_1000_requests",
    "tests/process/test_grpc.py::test_errors_map_to_status_codes_with_the_tgw_code",
    "tests/process/test_grpc.py::test_deadline_and_cancellation",
    "tests/process/test_grpc.py::test_tenant_and_traceparent_metadata",
    "tests/process/test_readiness.py::test_the_routing_key_header_reaches_the_canary_split",
    "tests/process/test_cancellation.py::test_a_pipeline_request_whose_http_caller_closes_stops",
]
# TGW_SLOW=1: every module that drives the HTTP or gRPC face
FACE_MODULES = [
    "tests/process/test_http.py", "tests/process/test_http_raw_bodies.py", "tests/process/test_http_triton_docs.py",
    "tests/process/test_http_generate.py", "tests/process/test_grpc.py", "tests/process/test_grpc_streams.py",
    "tests/process/test_grpc_generation.py", "tests/process/test_grpc_secure.py", "tests/process/test_cancellation.py",
    "tests/process/test_readiness.py", "tests/process/test_tracing.py", "tests/process/test_triton_protocol.py",
    "tests/process/test_triton_shm.py", "tests/process/test_triton_words.py", "tests/process/test_bytes_tensors.py",
    "tests/process/test_jobs.py", "tests/process/test_openai.py", "tests/process/test_pipelines.py",
]


@pytest.fixture(scope="module")
def fronted(model_files):
    d = tempfile.mkdtemp(prefix="tgwf-", dir="/tmp")
    cfg = base_config(model_files, "mlp", server={"front_processes": 2})
    cfg.update(http={"port": 0}, grpc={"port": 0})
    yield from served(cfg, d, http=True, grpc=True)


def fronts(b) -> dict:
    with Client(b.address) as c:
        return c.status()["fronts"]


def serving(b) -> dict[int, int]:
    """index -> pid of each front that said HELLO."""
    return {life["index"]: life["pid"] for life in fronts(b)["lives"] if life["hello"]}


def test_each_front_is_named_serves_both_faces_and_reports_its_figures(fronted):
    """The front side: its title, both faces' inference done there (answers equal the native
    socket's), the other routes forwarded, and its STATS (taken, forwarded, the collector frozen)
    in status. (Supervision, restarts and a front killed under load: test_fronts.py.)"""
    b = fronted
    wait_until(lambda: len(serving(b)) == 2, 30, "both fronts serving")
    pids = serving(b)
    assert {psutil.Process(pid).name() for pid in pids.values()} == {"tgw-front-0", "tgw-front-1"}
    x = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32)
    with Client(b.address) as c:
        want = c.infer("mlp", {"x": x})["y"]
    for _ in range(8):   # a new connection each: the kernel spreads them over both fronts
        h = httpclient.InferenceServerClient(b.http.removeprefix("http://"))
        i = httpclient.InferInput("x", list(x.shape), "FP32")
        i.set_data_from_numpy(x, binary_data=True)
        np.testing.assert_array_equal(h.infer("mlp", [i]).as_numpy("y"), want)
        assert h.is_server_ready()   # forwarded to the broker's own face
        h.close()
        g = grpcclient.InferenceServerClient(b.grpc)
        i = grpcclient.InferInput("x", list(x.shape), "FP32")
        i.set_data_from_numpy(x)
        np.testing.assert_array_equal(g.infer("mlp", [i]).as_numpy("y"), want)
        g.close()

    def reported():
        lives = fronts(b)["lives"]
        return lives if sum(life["requests"] for life in lives) >= 16 and \
            sum(life["forwarded"] for life in lives) >= 8 else None
    lives = wait_until(reported, 10, "the fronts' STATS")
    assert all(life["gc"]["frozen"] and life["inflight"] == 0 for life in lives)   # server.gc_freeze's default


@pytest.mark.timeout(900 if SLOW else 240)
def test_the_face_tests_pass_with_two_fronts():
    """The face tests as they are, every broker they start with two fronts."""
    chosen = FACE_MODULES if SLOW else SHORT
    env = {**os.environ, "TGW_TEST_FRONTS": "2"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *chosen],
                         cwd=ROOT, env=env, capture_output=True, text=True)
    tail = (run.stdout + run.stderr)[-6000:]
    assert run.returncode == 0, tail
    assert " passed" in tail and " failed" not in tail, tail
