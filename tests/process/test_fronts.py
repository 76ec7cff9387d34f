"""Front processes supervised by the broker (docs/FRONTS.md "Supervision"): two fronts on the
public HTTP and gRPC ports (port 0: the broker picks and holds it), their requests answered
exactly as the native socket answers them, a route a front forwards to the broker's own face
answered, a front SIGKILLed under load losing no answer (callers whose connection died retry,
and land on a live front), restarted and counted; at stop, every front gone with the broker.

One broker for the module; the kill test runs last and stops it itself (a restarted front is a
new process: the broker's stop must take it too)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import tempfile
import urllib.request

import aiohttp
import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from conftest import base_config, in_flight, served, wait_until
from tgw.client import Client

pytestmark = pytest.mark.process

FRONTS = 2
CALLERS, EACH = 8, 25   # the load during the kill: callers, requests each


@pytest.fixture(scope="module")
def fronted(model_files):
    d = tempfile.mkdtemp(prefix="tgwf-", dir="/tmp")
    cfg = base_config(model_files, "mlp", server={"front_processes": FRONTS},
                      supervisor={"crash_loop": {"backoff_s": 1.0}})
    cfg.update(http={"port": 0}, grpc={"port": 0})
    yield from served(cfg, d, http=True, grpc=True)


def scrape(b) -> str:
    with urllib.request.urlopen(f"{b.http}/metrics", timeout=30) as r:
        return r.read().decode()


def fronts_of(b) -> dict:
    with Client(b.address) as c:
        return c.status()["fronts"]


def test_two_fronts_serve_both_faces_and_forward_the_rest(fronted):
    fronts = fronts_of(fronted)
    assert (fronts["configured"], fronts["alive"], fronts["restarts"], fronts["ready"]) == (FRONTS, FRONTS, 0, True)
    pids = sorted(life["pid"] for life in fronts["lives"])
    assert len(set(pids)) == FRONTS and all(psutil.Process(pid).ppid() == fronted.proc.pid for pid in pids)
    # the public addresses, not the broker's own faces' Unix sockets
    assert fronted.http.startswith("http://") and ":0" not in fronted.http and not fronted.grpc.startswith("unix:")
    assert fronts["public"] == {"http": fronted.http, "grpc": fronted.grpc}

    x = np.random.default_rng(3).standard_normal((2, 256), dtype=np.float32)
    with Client(fronted.address) as native:
        want = native.infer("mlp", {"x": x})["y"]
    http = httpclient.InferenceServerClient(fronted.http.removeprefix("http://"))
    try:
        assert http.is_server_ready()
        inp = httpclient.InferInput("x", [2, 256], "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        np.testing.assert_array_equal(http.infer("mlp", [inp]).as_numpy("y"), want)
        config = http.get_model_config("mlp")   # a route the broker's own face answers
        assert config["name"] == "mlp" and config["max_batch_size"] > 0
    finally:
        http.close()
    grpc = grpcclient.InferenceServerClient(fronted.grpc)
    try:
        inp = grpcclient.InferInput("x", [2, 256], "FP32")
        inp.set_data_from_numpy(x)
        np.testing.assert_array_equal(grpc.infer("mlp", [inp]).as_numpy("y"), want)
        meta = grpc.get_model_metadata("mlp", as_json=True)
        assert meta["name"] == "mlp" and meta["inputs"][0]["name"] == "x"
    finally:
        grpc.close()
    metrics = scrape(fronted)
    assert f"tgw_front_processes {FRONTS}.0" in metrics and "tgw_front_restarts_total 0.0" in metrics


async def _load(url: str, inputs: list[np.ndarray], answers: list, started: asyncio.Event) -> None:
    """CALLERS callers, EACH requests each, one at a time; a request whose connection failed
    (its front died) is sent again on a new connection. Every answer kept in `answers`."""
    async def caller(k: int) -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
            for n in range(EACH):
                x = inputs[(k + n) % len(inputs)]
                body = {"inputs": [{"name": "x", "shape": [1, 256], "datatype": "FP32", "data": x.tolist()}]}
                while True:
                    try:
                        async with session.post(f"{url}/v2/models/mlp/infer", json=body) as resp:
                            answers.append((k, n, resp.status, await resp.json(), (k + n) % len(inputs)))
                            break
                    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError):
                        continue   # its front is gone: a new connection lands on a live one
                if n == 2:
                    started.set()
    await asyncio.gather(*(caller(k) for k in range(CALLERS)))


def test_a_front_killed_under_load_loses_no_answer_and_is_restarted(fronted):
    rng = np.random.default_rng(11)
    inputs = [rng.standard_normal((1, 256), dtype=np.float32) for _ in range(4)]
    with Client(fronted.address) as native:
        wants = [native.infer("mlp", {"x": x})["y"] for x in inputs]
    victim = fronts_of(fronted)["lives"][0]["pid"]
    answers: list = []

    async def run() -> None:
        started = asyncio.Event()
        load = asyncio.ensure_future(_load(fronted.http, inputs, answers, started))
        await asyncio.wait_for(started.wait(), 60)
        os.kill(victim, signal.SIGKILL)   # a front of this broker's, by its pid from status
        await asyncio.wait_for(load, 120)
    asyncio.run(run())

    assert len(answers) == CALLERS * EACH and len({(k, n) for k, n, *_ in answers}) == CALLERS * EACH
    for k, n, status, doc, which in answers:
        assert status == 200, doc
        got = np.array(doc["outputs"][0]["data"], dtype=np.float32).reshape(1, 10)
        np.testing.assert_array_equal(got, wants[which])

    def restarted():
        fronts = fronts_of(fronted)
        return fronts if fronts["restarts"] == 1 and fronts["alive"] == FRONTS else None
    fronts = wait_until(restarted, 60, "the killed front started again")
    pids = [life["pid"] for life in fronts["lives"]]
    assert victim not in pids and len(set(pids)) == FRONTS

    with Client(fronted.address) as c:
        wait_until(lambda: in_flight(c) == 0 and c.stats()["models"]["mlp"]["queued"] == 0, 30, "nothing in flight")
        stats = c.stats()
        assert stats["clients"]["owed"] == 0
        mlp, where = stats["models"]["mlp"], stats["cancelled"].get("mlp", {})
        # every admitted request accounted for: answered, or withdrawn with its dead front (nobody
        # else withdraws here: the queued ones are the abandoned front_gone)
        assert mlp["requests"] == mlp["replies"] + sum(mlp["errors"].values()) + sum(where.values()), (mlp, where)
        assert stats["abandoned"].get("front_gone", 0) == where.get("queued", 0), (stats["abandoned"], where)
        assert mlp["replies"] >= CALLERS * EACH   # the callers' answers, and those their dead front owed
    assert "tgw_front_restarts_total 1.0" in scrape(fronted)

    code = fronted.stop()
    assert code == 0, fronted.output()
    wait_until(lambda: not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                               for pid in pids), 30, "the fronts to exit with the broker")
    folder = os.path.dirname(fronted.address.removeprefix("ipc://"))
    assert not [f for f in os.listdir(folder) if f.endswith(".fronts")]   # the run folder removed
