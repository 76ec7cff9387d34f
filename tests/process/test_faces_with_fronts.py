"""The HTTP and gRPC faces served by front processes (server.front_processes, docs/FRONTS.md).

Two checks: a broker with two fronts serves both faces through them (the processes are there,
named, counted; a front killed under load is replaced and every request the broker admitted is
answered or withdrawn, none left owed), and the existing face tests pass unchanged with
TGW_TEST_FRONTS=2 (tests/conftest.py gives every broker they start two fronts): a chosen
subset in the default run, every face test module with TGW_SLOW=1.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading

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


@pytest.fixture
def fronted(model_files):   # the test's own: the fronts it restarts are gone when it ends (leak_guard)
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


def test_two_fronts_serve_both_faces_and_a_killed_one_is_replaced(fronted):
    b = fronted
    wait_until(lambda: len(serving(b)) == 2, 30, "both fronts serving")
    pids = serving(b)
    kids = {p.pid: p for p in psutil.Process(b.proc.pid).children()}
    assert {kids[pid].name() for pid in pids.values()} == {"tgw-front-0", "tgw-front-1"}
    x = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32)
    with Client(b.address) as c:
        want = c.infer("mlp", {"x": x})["y"]
    h = httpclient.InferenceServerClient(b.http.removeprefix("http://"))
    g = grpcclient.InferenceServerClient(b.grpc)

    def http_infer():
        i = httpclient.InferInput("x", list(x.shape), "FP32")
        i.set_data_from_numpy(x, binary_data=True)
        return h.infer("mlp", [i]).as_numpy("y")

    def grpc_infer():
        i = grpcclient.InferInput("x", list(x.shape), "FP32")
        i.set_data_from_numpy(x)
        return g.infer("mlp", [i]).as_numpy("y")

    for _ in range(8):   # new connections each: the kernel spreads them over both fronts
        np.testing.assert_array_equal(http_infer(), want)
        np.testing.assert_array_equal(grpc_infer(), want)
    wait_until(lambda: sum(life["requests"] for life in fronts(b)["lives"]) >= 16, 10, "the fronts' STATS")
    assert all(life["gc"].get("frozen") for life in fronts(b)["lives"])   # server.gc_freeze's default

    # a front killed while callers load both: the other serves on, the dead one is started again,
    # and the broker owes nothing afterwards (what the dead one had admitted was withdrawn)
    stop, errors, answered = threading.Event(), [], [0]

    def load():
        mine = httpclient.InferenceServerClient(b.http.removeprefix("http://"))
        i = httpclient.InferInput("x", list(x.shape), "FP32")
        i.set_data_from_numpy(x, binary_data=True)
        while not stop.is_set():
            try:
                got = mine.infer("mlp", [i]).as_numpy("y")
            except Exception:   # the killed front's connection: a new one goes to a live front
                mine.close()
                mine = httpclient.InferenceServerClient(b.http.removeprefix("http://"))
                continue
            # batched with others, a row may differ from computing it alone in the last bits
            if not np.allclose(got, want, rtol=1e-5, atol=1e-6):
                errors.append(float(np.abs(got - want).max()))
            answered[0] += 1
        mine.close()

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: answered[0] >= 20, 30, "load through the fronts")
        os.kill(pids[0], signal.SIGKILL)
        wait_until(lambda: serving(b).get(0) not in (None, pids[0]), 30, "front 0 started again")
        seen = answered[0]
        wait_until(lambda: answered[0] >= seen + 20, 30, "load served on after the restart")
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors[:3]
    assert fronts(b)["restarts"] >= 1
    with Client(b.address) as c:
        wait_until(lambda: c.stats()["clients"]["owed"] == 0, 10, "nothing owed")
    np.testing.assert_array_equal(http_infer(), want)
    h.close()
    g.close()


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
