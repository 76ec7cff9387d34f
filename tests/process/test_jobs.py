"""Polled jobs end to end (docs/JOBS.md): one real broker with the HTTP face, one CPU worker
serving the Recorder stage (tgw.testing.cancel_stage: a gated row holds its batch until a file
exists, so a job is seen running before it ends) and the Counter generator (output n of a prompt
is (sum(prompt) + n) % 1000). The store's rules under an injected clock: tests/unit/test_job_store.py.

Native client: a one-shot job seen running, then its result equal to the direct call's, read
again from another client by id; a pipeline's; a generation's outputs read so far, then its result equal to
the direct stream's; a cancelled generation's slot freed by the worker's own count; refusals at
submit. HTTP (aiohttp): the same through /v2/models/{m}/jobs and /v2/jobs/{id}. Last, the broker
restarted: both faces answer the old ids "jobs do not survive a broker restart".
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile

import aiohttp
import numpy as np
import pytest
from conftest import served, wait_until

from tgw.client import AsyncClient, Client, JobCancelled, JobNotFoundError, ModelNotFoundError
from tgw.testing.cancellation import recorder
from tgw.testing.generators import counter_outputs, entry

pytestmark = pytest.mark.process
WAIT_S = 60.0


@pytest.fixture(scope="module")
def broker():
    d = tempfile.mkdtemp(prefix="tgwj-", dir="/tmp")
    cfg = {"workers": {"devices": ["cpu"], "threads_per_worker": 1, "input_arena_mb": 4, "output_arena_mb": 2},
           "http": {"host": "127.0.0.1", "port": 0},
           "models": [recorder("gate", os.path.join(d, "computed.log"), os.path.join(d, "gate"), max_batch_size=1),
                      entry("cnt", options={"step_ms": 5}, max_sequences=2, max_outputs=1_000_000)],
           "pipelines": [{"name": "twice", "inputs": ["x"], "outputs": {"y": "b.y"},
                          "steps": [{"name": "a", "model": "gate", "inputs": {"x": "x"}},
                                    {"name": "b", "model": "gate", "inputs": {"x": "a.y"}}]}]}
    yield from served(cfg, d, http=True, work=d)


def generation(c: Client) -> dict:
    return c.status()["models"]["cnt"]["generation"]


def gated(tag: float) -> np.ndarray:
    return np.array([[tag, 1, 2, 3]], np.float32)   # column 1 == 1: its batch waits for the gate file


def open_gate(broker) -> None:
    open(os.path.join(broker.work, "gate"), "w").close()


def close_gate(broker) -> None:
    os.remove(os.path.join(broker.work, "gate"))


def test_native_jobs_one_shot_generation_cancel_and_refusals(broker):
    with Client(broker.address) as c:
        job = c.submit("gate", {"x": gated(7)})
        wait_until(lambda: job.status()["state"] == "running", WAIT_S, "the gated job on its worker")
        open_gate(broker)
        try:
            result = job.result(timeout=WAIT_S)
            assert np.array_equal(result["y"], c.infer("gate", {"x": gated(7)})["y"])
            with Client(broker.address) as other:   # re-attached by id from another connection
                again = other.job(job.id)
                assert np.array_equal(again.result(timeout=WAIT_S)["y"], result["y"])
                status = again.status()
                assert (status["state"], status["model"], status["version"]) == ("done", "gate", "1")
                assert status["run_ms"] > 0 and 0 < status["expires_in_s"] <= 600
        finally:
            close_gate(broker)

        gen = c.submit("cnt", np.array([3, 4]), generate={"max_outputs": 300})
        so_far = gen.outputs(wait=WAIT_S)   # answered once the first outputs are in
        assert so_far and so_far == counter_outputs([3, 4], len(so_far))
        assert gen.result(timeout=WAIT_S) == counter_outputs([3, 4], 300) == list(c.generate("cnt", [3, 4],
                                                                                                max_outputs=300))
        assert gen.status()["end"]["reason"] == "max_outputs"

        base = generation(c)["freed_by_cancel"]
        long = c.submit("cnt", np.array([1]), generate={"max_outputs": 1_000_000})
        assert long.outputs(wait=WAIT_S)
        assert long.cancel()["state"] == "cancelled"
        wait_until(lambda: generation(c)["freed_by_cancel"] > base and generation(c)["active"] == 0, WAIT_S,
                   "the cancelled generation's slot freed by its worker")
        with pytest.raises(JobCancelled):
            long.result(timeout=WAIT_S)

        row = {"x": np.array([[4, 5, 5, 6]], np.float32)}   # a pipeline as a job: its steps ungated
        assert np.array_equal(c.submit("twice", row).result(timeout=WAIT_S)["y"], c.infer("twice", row)["y"])

        async def via_async() -> tuple[list, list]:   # AsyncClient: the same calls, awaited
            async with AsyncClient(broker.address) as ac:
                one = await ac.submit("cnt", np.array([8]), generate={"max_outputs": 5})
                return await one.result(timeout=WAIT_S), await ac.job(one.id).outputs()
        assert asyncio.run(via_async()) == (counter_outputs([8], 5), counter_outputs([8], 5))

        with pytest.raises(ModelNotFoundError):   # refused at submit: no job
            c.submit("nope", {"x": gated(1)})
        with pytest.raises(JobNotFoundError, match="unknown job"):
            c.job("nonsense").status()
        counts = c.status()["jobs"]
        assert (counts["submitted"], counts["done"], counts["cancelled"], counts["live"]) == (5, 4, 1, 0)


async def http_jobs(base: str, work: str) -> None:
    async with aiohttp.ClientSession(base) as s:
        body = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": gated(9).ravel().tolist()}]}
        async with s.post("/v2/models/gate/jobs", json=body) as r:
            assert r.status == 202, await r.text()
            accepted = await r.json()
        url = accepted["status_url"]
        assert url == f"/v2/jobs/{accepted['job_id']}"
        while True:   # polled until seen on its worker, the gate shut
            async with s.get(url) as r:
                if (await r.json())["state"] == "running":
                    break
        async with s.get(url + "/result") as r:   # not done yet: the status, 202
            assert r.status == 202 and r.headers["Retry-After"] and (await r.json())["state"] == "running"
        open(os.path.join(work, "gate"), "w").close()
        try:
            async with s.get(url, params={"wait_ms": str(int(WAIT_S * 1000))}) as r:
                doc = await r.json()
                assert doc.get("state") == "done", doc
            async with s.get(url + "/result") as r:
                result = await r.json()
            async with s.post("/v2/models/gate/infer", json=body) as r:
                direct = await r.json()
            assert result["outputs"] == direct["outputs"] and result["model_name"] == "gate"
            async with s.get(url + "/result", params={"binary_data": "true"}) as r:
                raw = await r.read()
                n = int(r.headers["Inference-Header-Content-Length"])
            assert np.array_equal(np.frombuffer(raw[n:], np.float32), np.asarray(direct["outputs"][0]["data"],
                                                                                  np.float32))
        finally:
            os.remove(os.path.join(work, "gate"))

        prompt = {"inputs": [{"name": "prompt", "shape": [1, 2], "datatype": "INT64", "data": [5, 6]}],
                  "parameters": {"max_tokens": 200}}
        async with s.post("/v2/models/cnt/jobs", json=prompt) as r:
            gen = (await r.json())["status_url"]
        seen: list[int] = []
        while True:   # incremental polling: each read from where the last one ended
            async with s.get(gen, params={"since": str(len(seen)), "wait_ms": "5000"}) as r:
                doc = await r.json()
            assert doc["first"] == len(seen)
            seen += doc["outputs"][0]["data"] if doc["count"] else []
            if doc["state"] == "done" and len(seen) == doc["total"]:
                break
        assert seen == counter_outputs([5, 6], 200)
        async with s.get(gen + "/result") as r:
            assert (await r.json())["outputs"][0]["data"] == seen

        async with s.post("/v2/models/cnt/jobs", json={**prompt, "parameters": {"max_tokens": 1_000_000}}) as r:
            long = (await r.json())["status_url"]
        async with s.get(long, params={"wait_ms": "60000"}) as r:
            assert (await r.json())["count"] > 0
        async with s.delete(long) as r:
            assert r.status == 200 and (await r.json())["state"] == "cancelled"
        async with s.get(long + "/result") as r:
            assert r.status == 409 and (await r.json())["code"] == "CANCELLED"

        async with s.post("/v2/models/gate/jobs", json={**body, "parameters": {"max_tokens": 3}}) as r:
            assert r.status == 400 and "is for generators" in (await r.json())["error"]
        async with s.get("/v2/jobs/nonsense") as r:
            assert r.status == 404 and "unknown job" in (await r.json())["error"]
        async with s.get(gen, params={"since": "-1"}) as r:
            assert r.status == 400
        async with s.get("/metrics") as r:
            metrics = await r.text()
        assert 'tgw_jobs_events_total{event="cancelled"} 2.0' in metrics and 'tgw_jobs{state="live"} 0.0' in metrics


def test_http_jobs_one_shot_generation_cancel_and_errors(broker):
    asyncio.run(asyncio.wait_for(http_jobs(broker.http, broker.work), 4 * WAIT_S))
    with Client(broker.address) as c:
        wait_until(lambda: generation(c)["active"] == 0, WAIT_S, "the cancelled HTTP job's slot freed")


def test_a_restarted_broker_answers_old_ids_clearly(broker):
    with Client(broker.address) as c:   # the submitter gone: its job goes on
        old = c.submit("cnt", np.array([2]), generate={"max_outputs": 3})
    with Client(broker.address) as c:
        assert c.job(old.id).result(timeout=WAIT_S) == [2, 3, 4]
        printed = subprocess.run([sys.executable, "-m", "tgw.broker", "status", "--address", broker.address],
                                 capture_output=True, text=True, timeout=60)
        assert printed.returncode == 0 and "jobs: 0 live, " in printed.stdout, printed.stderr
    assert broker.stop() == 0
    broker.start()
    try:
        with Client(broker.address) as c:
            with pytest.raises(JobNotFoundError, match="jobs do not survive a broker restart"):
                c.job(old.id).status()
            http = c.status()["http"]

        async def ask() -> tuple[int, dict]:
            async with aiohttp.ClientSession(http) as s:
                async with s.get(f"/v2/jobs/{old.id}") as r:
                    return r.status, await r.json()
        status, doc = asyncio.run(ask())
        assert status == 404 and "earlier broker run" in doc["error"]
    finally:   # the last test of the module: the restarted broker is this test's to stop
        assert broker.stop() == 0

