"""Sequence batching end to end (issue 41, docs/SEQUENCES.md): a real broker with two CPU
workers serving the demo accumulator (a TorchScript file written for Triton's PyTorch backend:
OUTPUT is the running sum of its sequence's INPUTs, kept in the worker's state slot), driven by
the native client and over HTTP.

Interleaved sequences keep their own sums (a step on the wrong worker or slot would answer the
wrong sum), status counts no step sent to a worker that did not hold its sequence, and each
refusal says why: no id, never started, ended by its end flag, idle past its timeout.
"""
from __future__ import annotations

import asyncio
import json
import tempfile
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest

from conftest import served, wait_until
from tgw.client import AsyncClient, Client
from tgw.shm.errors import TgwError
from tgw.workers.demo_sequence import build_sequence_decls

pytestmark = pytest.mark.process
SLOTS = 4   # per worker


def entry(name: str, decl: dict, idle_us: int) -> dict:
    return {"name": name, "versions": [{"version": "1", "path": decl["path"], "format": "torchscript"}],
            "inputs": decl["inputs"], "outputs": decl["outputs"], "max_batch_size": 8,
            "sequence_batching": {**decl["sequence_batching"], "max_sequences": SLOTS,
                                  "max_sequence_idle_us": idle_us}}


@pytest.fixture(scope="module")
def broker():
    d = tempfile.mkdtemp(prefix="tgwq-", dir="/tmp")
    acc = build_sequence_decls(d)["accumulator"]
    cfg = {"workers": {"devices": ["cpu", "cpu"], "threads_per_worker": 1, "input_arena_mb": 4,
                       "output_arena_mb": 2},
           "http": {"port": 0},
           "models": [entry("acc", acc, 60_000_000), entry("acc-idle", acc, 200_000)]}
    yield from served(cfg, d, http=True)


def step(c: Client, cid, x: int, model: str = "acc", **flags) -> int:
    return int(c.infer(model, {"INPUT": np.array([[x]], np.int32)}, sequence_id=cid, **flags)["OUTPUT"][0, 0])


def refused(c: Client, cid, model: str = "acc", **flags) -> TgwError:
    with pytest.raises(TgwError) as info:
        step(c, cid, 1, model, **flags)
    return info.value


def counters(c: Client, model: str = "acc") -> dict:
    return c.status()["models"][model]["sequences"]


def test_interleaved_sequences_keep_their_own_state_on_their_own_worker(broker):
    with Client(broker.address) as c:
        assert counters(c)["slots"] == 2 * SLOTS   # both workers said their pool's size
        assert step(c, 11, 3, sequence_start=True) == 3
        assert step(c, 12, 10, sequence_start=True) == 10
        assert step(c, 11, 4) == 7 and step(c, 12, 5) == 15
        assert step(c, 11, 5, sequence_end=True) == 12
        assert step(c, 12, 1, sequence_end=True) == 16
        err = refused(c, 11)
        assert err.code.value == "INVALID_ARGUMENT" and "must specify the START flag" in err.message \
            and "its request with sequence_end was answered" in err.message
        assert "no sequence of that id was started" in refused(c, 999).message
        with pytest.raises(TgwError, match="must specify a non-zero or non-empty correlation ID"):
            c.infer("acc", {"INPUT": np.array([[1]], np.int32)})

    # more sequences at once than both workers' slots, each stepped by its own caller: the starts
    # that find no slot wait for one without holding back the sequences that hold one
    sums, errors = {}, []

    def run(cid: int) -> None:
        with Client(broker.address) as own:
            try:
                total = 0
                for k in range(12):
                    total += cid + k
                    got = step(own, cid, cid + k, sequence_start=k == 0, sequence_end=k == 11)
                    assert got == total, f"sequence {cid} step {k}: {got} != {total}"
                sums[cid] = total
            except (AssertionError, TgwError) as exc:
                errors.append(exc)
    threads = [threading.Thread(target=run, args=(cid,)) for cid in range(100, 100 + 3 * SLOTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(sums) == 3 * SLOTS, errors
    with Client(broker.address) as c:
        n = counters(c)
        assert n["misrouted"] == 0 and n["live"] == 0 and n["ended"] == {"end": 2 + 3 * SLOTS}
        assert n["steps"] == 6 + 12 * 3 * SLOTS and n["started"] == 2 + 3 * SLOTS and n["refused"] == 3
    with urllib.request.urlopen(f"{broker.http}/metrics", timeout=10) as r:
        assert 'tgw_sequence_misrouted_total{model="acc"} 0.0' in r.read().decode()


def test_a_sequence_steps_over_http_and_the_async_client(broker):
    def http(x: int, **params) -> int:
        body = json.dumps({"inputs": [{"name": "INPUT", "shape": [1, 1], "datatype": "INT32", "data": [x]}],
                           "parameters": {"sequence_id": 77, **params}}).encode()
        req = urllib.request.Request(f"{broker.http}/v2/models/acc/infer", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())["outputs"][0]["data"][0]
    assert http(2, sequence_start=True) == 2 and http(3) == 5

    async def more() -> int:
        async with AsyncClient(broker.address) as c:
            out = await c.infer("acc", {"INPUT": np.array([[4]], np.int32)}, sequence_id=77, sequence_end=True)
            return int(out["OUTPUT"][0, 0])
    assert asyncio.run(more()) == 9
    with pytest.raises(urllib.error.HTTPError) as err:
        http(1)
    assert err.value.code == 400 and "must specify the START flag" in err.value.read().decode()


def test_an_idle_sequence_ends_and_a_later_step_says_so(broker):
    with Client(broker.address) as c:
        assert step(c, 5, 2, "acc-idle", sequence_start=True) == 2
        wait_until(lambda: counters(c, "acc-idle")["ended"].get("idle") == 1, 30, "the idle sequence to end")
        err = refused(c, 5, "acc-idle")
        assert "the sequence ended: no request for 0.2 s (sequence_batching.max_sequence_idle_us 200000)" \
            in err.message and "send a request with sequence_start" in err.message
        assert counters(c, "acc-idle")["live"] == 0
        assert step(c, 5, 6, "acc-idle", sequence_start=True, sequence_end=True) == 6   # it starts again
