"""Cancellation end to end (issue 25 item 4): a request whose caller gives up - a native cancel, a
client closing, an HTTP connection closed, a caller process killed, a sync call timing out - is
withdrawn wherever it is: dropped from its queue, taken out of its staged batch before launch
(the batch shrinks, its neighbours' answers exact), or, computing, its answer dropped; a
pipeline's run stops. Counted by model and where (stats `cancelled`, tgw_requests_cancelled_total).

One broker, one CPU worker serving the Recorder stage (tgw.testing.cancel_stage), which logs every
row it computes: "never computed" is the worker's own count. A gate request holds the worker
until the test opens the gate (a file), so what waits behind it waits by construction, not by
timing. TGW_SLOW=1 runs the measured scenario with 1,000 requests (default 200).
"""
from __future__ import annotations

import asyncio
import os
import tempfile
import threading
import urllib.request

import numpy as np
import pytest

from conftest import served
from tgw.testing.cancellation import (config, computed, delta, http_send, in_flight, recorder, row, scenario,
                                    wait_for)
from tgw.client import Client, DeadlineExceededError
from tgw.client.aio import AsyncClient

SLOW = os.environ.get("TGW_SLOW") == "1"


@pytest.fixture(scope="module")
def broker():
    d = tempfile.mkdtemp(prefix="tgwx-", dir="/tmp")
    log = os.path.join(d, "computed.log")
    cfg = config(d, recorder("rec8", log, max_batch_size=8, max_delay_us=5_000_000),   # one batch of all 8
                 recorder("gate2", log, os.path.join(d, "gate"), max_batch_size=1))    # a gate with no history
    cfg["pipelines"] = [{"name": "twice", "inputs": ["x"],
                         "steps": [{"name": "first", "model": "rec", "inputs": {"x": "x"}},
                                   {"name": "second", "model": "rec", "inputs": {"x": "first.y"}}],
                         "outputs": {"y": "second.y"}}]
    yield from served(cfg, d, http=True, work=d)


@pytest.fixture
def fresh(broker):
    """The worker idle, the gate closed, the log empty; yields a sync client for stats."""
    with Client(broker.address) as c:
        idle(c)
        for name in ("computed.log", "gate"):
            path = os.path.join(broker.work, name)
            if os.path.exists(path):
                os.remove(path)
        yield c
        open_gate(broker)   # never leave the worker held


def idle(c: Client) -> dict:
    def look():
        s = c.stats()
        return s if in_flight(s) == 0 and all(m["queued"] == 0 for m in s["models"].values()) else None
    return wait_for(look, "the worker idle")


def open_gate(broker) -> None:
    open(os.path.join(broker.work, "gate"), "w").close()


async def hold(ac: AsyncClient, c: Client, model: str = "gate"):
    """The gate request, computing on the worker (until the gate opens)."""
    task = asyncio.ensure_future(ac.infer(model, {"x": row(-1, gate=True)}, timeout=120))
    await asyncio.to_thread(wait_for, lambda: in_flight(c.stats()) >= 1, "the gate batch on the worker")
    return task


def test_callers_giving_up_behind_a_slow_batch_are_never_computed(broker, fresh):
    """The measured scenario: cancel, close, HTTP closed, process killed; the keepers exact."""
    n = 1000 if SLOW else 200
    r = asyncio.run(scenario(broker, broker.work, n, keepers=20))
    assert r["never_computed_share"] >= 0.99, r
    assert r["keepers_exact"] and r["keepers_computed"] == 20, r
    assert sum(r["cancelled"].values()) == n and r["cancelled"].get("staged", 0) >= 1, r
    assert set(r["cancelled"]) <= {"queued", "staged", "computing"}, r
    with urllib.request.urlopen(f"{broker.http}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    assert 'tgw_requests_cancelled_total{model="rec",where="staged"}' in text
    assert 'tgw_requests_cancelled_total{model="rec",where="queued"}' in text


def test_a_staged_batch_shrinks_and_its_neighbours_are_exact(broker, fresh):
    c = fresh
    before = c.stats()

    async def main():
        async with AsyncClient(broker.address) as ac:
            gate = await hold(ac, c)
            tags = list(range(1000, 1008))   # keep, withdraw, keep, ...: all eight in one batch (rec8)
            tasks = {t: asyncio.ensure_future(ac.infer("rec8", {"x": row(t)}, timeout=120)) for t in tags}
            await asyncio.to_thread(wait_for, lambda: (s := c.stats())["models"]["rec8"]["queued"] == 0
                                    and in_flight(s) == 2, "the batch of eight staged behind the gate")
            withdrawn = tags[1::2]
            for t in withdrawn:
                tasks[t].cancel()
            await asyncio.to_thread(wait_for, lambda: c.stats()["clients"]["owed"] == 5, "four withdrawn")
            open_gate(broker)
            kept = {t: await tasks[t] for t in tags[0::2]}
            await gate
            return withdrawn, kept

    withdrawn, kept = asyncio.run(main())
    after = idle(c)
    for t, out in kept.items():
        np.testing.assert_array_equal(out["y"], row(t) + 1)
    assert sorted(computed(broker.work)) == [-1, *sorted(kept)]   # the worker never saw the withdrawn rows
    assert delta(before, after, "rec8") == {"staged": 4}
    sizes = after["models"]["rec8"]["batch_sizes"]
    assert {int(k): v for k, v in sizes.items()} == {**{int(k): v for k, v in before["models"]["rec8"]
                                                        ["batch_sizes"].items()}, 4: 1}   # it ran as 4 rows


def test_a_computing_request_withdrawn_is_computed_and_its_answer_dropped(broker, fresh):
    c = fresh
    before = c.stats()

    async def main():
        async with AsyncClient(broker.address) as ac:
            gate = await hold(ac, c)
            gate.cancel()   # it is on the worker, launched: computed anyway, nobody answered
            await asyncio.gather(gate, return_exceptions=True)
            await asyncio.to_thread(wait_for, lambda: c.stats()["clients"]["owed"] == 0, "the gate withdrawn")
            open_gate(broker)

    asyncio.run(main())
    after = idle(c)
    assert computed(broker.work) == [-1]
    assert delta(before, after, "gate") == {"computing": 1}
    assert after["models"]["gate"]["replies"] == before["models"]["gate"]["replies"]


def test_a_sync_call_that_times_out_withdraws_its_request(broker, fresh):
    c = fresh
    before = c.stats()
    raised = []
    caller = Client(broker.address)   # open until the end: its goodbye must not be what withdraws

    def call() -> None:
        try:
            caller.infer("rec", {"x": row(2000)}, timeout=5)
        except DeadlineExceededError as err:
            raised.append(err)

    async def main():
        async with AsyncClient(broker.address) as ac:
            gate = await hold(ac, c, "gate2")
            t = threading.Thread(target=call)
            t.start()
            await asyncio.to_thread(wait_for, lambda: in_flight(c.stats()) == 2, "its batch staged")
            await asyncio.to_thread(t.join, 60)
            await asyncio.to_thread(wait_for, lambda: c.stats()["clients"]["owed"] == 1, "the request withdrawn")
            open_gate(broker)
            await gate

    try:
        asyncio.run(main())
    finally:
        caller.close()
    after = idle(c)
    assert raised and raised[0].details.get("source") == "client"
    assert 2000 not in computed(broker.work)
    assert delta(before, after, "rec") == {"staged": 1}


def test_a_pipeline_request_whose_http_caller_closes_stops(broker, fresh):
    c = fresh
    before = c.stats()

    async def main():
        async with AsyncClient(broker.address) as ac:
            gate = await hold(ac, c)
            writer = await http_send(broker.http, "twice", 3000)
            await asyncio.to_thread(wait_for, lambda: c.stats()["models"]["rec"]["requests"]
                                    == before["models"]["rec"]["requests"] + 1, "its first step admitted")
            writer.close()
            await asyncio.to_thread(wait_for, lambda: c.stats()["clients"]["owed"] == 1, "the run stopped")
            open_gate(broker)
            await gate

    asyncio.run(main())
    after = idle(c)
    assert 3000 not in computed(broker.work)
    assert delta(before, after, "twice") == {"pipeline": 1}
    assert sum(delta(before, after, "rec").values()) == 1   # its first step, withdrawn (queued or staged)
    assert after["abandoned"].get("client_closed", 0) > before["abandoned"].get("client_closed", 0)
