"""Front processes supervised by the broker (docs/FRONTS.md "Supervision"): two fronts on the
public HTTP and gRPC ports (port 0: the broker picks and holds it), their requests answered
exactly as the native socket answers them, a route a front forwards to the broker's own face
answered, a front SIGKILLed under load losing no answer (callers whose connection died retry,
and land on a live front), restarted and counted; at stop, every front gone with the broker.

One broker for the module; the kill test runs last and stops it itself (a restarted front is a
new process: the broker's stop must take it too, or the leak guard sees it)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import tempfile
import threading
import time
import urllib.error
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
    cfg = base_config(model_files, "mlp", "spin", server={"front_processes": FRONTS},
                      supervisor={"crash_loop": {"backoff_s": 1.0}}, spin={"max_batch_size": 1})
    cfg.update(http={"port": 0}, grpc={"port": 0})
    yield from served(cfg, d, http=True, grpc=True)


def scrape(b) -> str:
    with urllib.request.urlopen(f"{b.http}/metrics", timeout=30) as r:
        return r.read().decode()


def fronts_of(b) -> dict:
    with Client(b.address) as c:
        return c.status()["fronts"]


def regions_of(b) -> dict:
    with Client(b.address) as c:
        return c.stats()["regions"]


def test_two_fronts_serve_both_faces_and_forward_the_rest(fronted):
    fronts = fronts_of(fronted)
    assert (fronts["configured"], fronts["alive"], fronts["restarts"], fronts["ready"]) == (FRONTS, FRONTS, 0, True)
    pids = sorted(life["pid"] for life in fronts["lives"])
    assert len(set(pids)) == FRONTS and all(psutil.Process(pid).ppid() == fronted.proc.pid for pid in pids)
    # the public addresses, not the broker's own faces' Unix sockets
    assert fronted.http.startswith("http://") and ":0" not in fronted.http and not fronted.grpc.startswith("unix:")
    assert fronts["public"] == {"http": fronted.http, "grpc": fronted.grpc}

    # each front's input region registered (fronts/region.py); a 16 KiB input (its threshold)
    # crosses in it, a 2 KiB one as a frame
    wait_until(lambda: regions_of(fronted)["registered"] == FRONTS, 30, "each front's input region")
    resolved = regions_of(fronted)["inputs"]
    x = np.random.default_rng(3).standard_normal((2, 256), dtype=np.float32)
    big = np.random.default_rng(4).standard_normal((16, 256), dtype=np.float32)
    with Client(fronted.address) as native:
        want, want_big = native.infer("mlp", {"x": x})["y"], native.infer("mlp", {"x": big})["y"]
    http = httpclient.InferenceServerClient(fronted.http.removeprefix("http://"))
    try:
        assert http.is_server_ready()
        inp = httpclient.InferInput("x", [2, 256], "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        np.testing.assert_array_equal(http.infer("mlp", [inp]).as_numpy("y"), want)
        inp = httpclient.InferInput("x", [16, 256], "FP32")
        inp.set_data_from_numpy(big, binary_data=True)
        np.testing.assert_array_equal(http.infer("mlp", [inp]).as_numpy("y"), want_big)
        config = http.get_model_config("mlp")   # a route the broker's own face answers
        assert config["name"] == "mlp" and config["max_batch_size"] > 0
    finally:
        http.close()
    grpc = grpcclient.InferenceServerClient(fronted.grpc)
    try:
        inp = grpcclient.InferInput("x", [2, 256], "FP32")
        inp.set_data_from_numpy(x)
        np.testing.assert_array_equal(grpc.infer("mlp", [inp]).as_numpy("y"), want)
        inp = grpcclient.InferInput("x", [16, 256], "FP32")
        inp.set_data_from_numpy(big)
        np.testing.assert_array_equal(grpc.infer("mlp", [inp]).as_numpy("y"), want_big)
        meta = grpc.get_model_metadata("mlp", as_json=True)
        assert meta["name"] == "mlp" and meta["inputs"][0]["name"] == "x"
    finally:
        grpc.close()
    assert regions_of(fronted)["inputs"] - resolved == 2   # the two large ones, read from the fronts' regions
    wait_until(lambda: sum(life["region"].get("placed", 0) for life in fronts_of(fronted)["lives"]) == 2, 30,
               "the fronts' STATS counting them")
    metrics = scrape(fronted)
    assert f"tgw_front_processes {FRONTS}.0" in metrics and "tgw_front_restarts_total 0.0" in metrics


def spin_over_http(b, rounds: float, out: list) -> None:
    body = json.dumps({"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [rounds]}]}).encode()
    req = urllib.request.Request(f"{b.http}/v2/models/spin/infer", data=body, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            out.append(r.status)
    except (urllib.error.URLError, ConnectionError) as exc:   # its front died: the connection with it
        out.append(type(exc).__name__)


def dead_fronts_leave_their_requests_unrun(fronted) -> None:
    """The worker held by a long native request, four HTTP requests admitted behind it (queued,
    or staged on the worker); both fronts killed: those four leave unrun, counted, their ring
    blocks and counts given back; both fronts start again."""
    with Client(fronted.address) as c:
        before = c.stats()
    fronts = fronts_of(fronted)
    held: list = []

    def hold() -> None:   # one worker, spin's batches of 1: everything after this waits for it
        with Client(fronted.address) as c:
            c.infer("spin", {"x": np.array([[10000.0]], np.float32)}, timeout=300)
        held.append(time.monotonic())
    threads = [threading.Thread(target=hold)]
    threads[0].start()
    wait_until(lambda: in_flight_of(fronted) >= 1, 30, "the long request on the worker")
    answers: list = []
    threads += [threading.Thread(target=spin_over_http, args=(fronted, 1.0, answers)) for _ in range(4)]
    for t in threads[1:]:
        t.start()
    wait_until(lambda: admitted(fronted, "spin") - before["models"]["spin"]["requests"] == 5, 30,
               "the four HTTP requests admitted")
    for life in fronts["lives"]:
        os.kill(life["pid"], signal.SIGKILL)
    killed_at = time.monotonic()
    for t in threads:
        t.join(300)
    assert held and held[0] > killed_at, "the premise: the worker was still held when the fronts died"
    assert len(answers) == 4 and 200 not in answers, answers   # their connections died with their fronts
    wait_until(lambda: (lambda f: f["restarts"] == fronts["restarts"] + 2 and f["alive"] == FRONTS)(fronts_of(fronted)),
               60, "both fronts started again")
    with Client(fronted.address) as c:
        wait_until(lambda: in_flight(c) == 0 and c.stats()["models"]["spin"]["queued"] == 0, 60, "nothing in flight")
        after = c.stats()
    spin, where, was = after["models"]["spin"], after["cancelled"].get("spin", {}), before["cancelled"].get("spin", {})
    assert spin["replies"] - before["models"]["spin"]["replies"] == 1   # the native one only: the four never ran
    assert sum(where.values()) - sum(was.values()) == 4, where
    gone = after["abandoned"].get("front_gone", 0) - before["abandoned"].get("front_gone", 0)
    assert gone == where.get("queued", 0) - was.get("queued", 0), (after["abandoned"], where)
    assert after["clients"]["owed"] == 0
    assert fronts_of(fronted)["ready"]


def admitted(b, model: str) -> int:
    with Client(b.address) as c:
        return c.stats()["models"][model]["requests"]


def in_flight_of(b) -> int:
    with Client(b.address) as c:
        return in_flight(c)


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


def test_killed_fronts_lose_nothing_restart_and_stop_with_the_broker(fronted):
    """(One test: a restarted front is a new child process, which only the broker's stop takes.)"""
    dead_fronts_leave_their_requests_unrun(fronted)
    a_front_killed_under_load_loses_no_answer(fronted)


def a_front_killed_under_load_loses_no_answer(fronted) -> None:
    rng = np.random.default_rng(11)
    inputs = [rng.standard_normal((1, 256), dtype=np.float32) for _ in range(4)]
    with Client(fronted.address) as native:
        wants = [native.infer("mlp", {"x": x})["y"] for x in inputs]
    victim = fronts_of(fronted)["lives"][0]["pid"]
    answers: list = []
    restarts = fronts_of(fronted)["restarts"]

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
        np.testing.assert_allclose(got, wants[which], rtol=1e-4, atol=1e-6)   # batched with others: float order

    def restarted():
        fronts = fronts_of(fronted)
        return fronts if fronts["restarts"] == restarts + 1 and fronts["alive"] == FRONTS else None
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
        assert mlp["replies"] >= CALLERS * EACH   # the callers' answers, and those their dead front owed
    assert f"tgw_front_restarts_total {restarts + 1}.0" in scrape(fronted)

    code = fronted.stop()
    assert code == 0, fronted.output()
    wait_until(lambda: not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                               for pid in pids), 30, "the fronts to exit with the broker")
    folder = os.path.dirname(fronted.address.removeprefix("ipc://"))
    assert not [f for f in os.listdir(folder) if f.endswith(".fronts")]   # the run folder removed
