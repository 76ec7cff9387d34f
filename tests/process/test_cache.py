"""The response cache (models[].cache, docs/CACHE.md) through a real broker: a repeated input is
answered without a worker (no batch), over the socket, HTTP, an output region and a pipeline's
steps; another version never hits; the bounds hold after many distinct inputs; a model without
the section caches nothing; the metrics and status show it; a hot swap drops the retired
version's answers at once and the new version computes.

Model "m" version k returns x + k (tgw.testing.lifecycle), so every answer names the version that
computed it. The hot swap runs last: it retires version 1.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import urllib.request

import numpy as np
import pytest

from conftest import served
from tgw.testing.lifecycle import control, model_decl, save_add_model
from tgw.client import AsyncClient, Client
from tgw.client.regions import output_bytes_for
from tgw.shm.wire import LoadVersion

ENTRIES = 32
ANSWER = 16 + 16   # one row's output (4 float32) and its key


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    paths = {k: save_add_model(str(root / f"add{k}.pt"), k) for k in (1, 2, 3)}
    m = model_decl("m", [("1", paths[1]), ("2", paths[2])], cache={"entries": ENTRIES, "max_bytes": 1 << 20})
    m["versions"][0]["weight"], m["versions"][1]["weight"] = 1, 0   # 2: reachable by name only
    cfg = {"model_roots": [str(root)], "http": {"port": 0},
           "workers": {"devices": ["cpu"], "input_arena_mb": 4, "output_arena_mb": 4},
           "models": [m, model_decl("plain", [("1", paths[1])])],
           "pipelines": [{"name": "twice", "inputs": ["x"], "outputs": {"y": "second.y"},
                          "steps": [{"name": "first", "model": "m", "inputs": {"x": "x"}},
                                    {"name": "second", "model": "m", "inputs": {"x": "first.y"}}]}]}
    yield from served(cfg, tempfile.mkdtemp(prefix="tgwc-", dir="/tmp"), http=True, paths=paths)


@pytest.fixture
def c(broker):
    with Client(broker.address) as client:
        yield client


def x_of(seed: float, rows: int = 1) -> np.ndarray:
    return np.full((rows, 4), seed, np.float32) + np.arange(4, dtype=np.float32)


def seen(c: Client, model: str = "m") -> tuple[dict, int]:
    """(its cache as status shows it, its batches computed so far)."""
    return c.status()["models"][model]["cache"], c.stats()["models"][model]["batches"]


def test_a_repeated_input_is_answered_without_a_worker(c):
    x = x_of(0.5, rows=3)
    first = c.infer_with_meta("m", {"x": x})
    cache, batches = seen(c)
    again = c.infer_with_meta("m", {"x": x})
    after, batches_after = seen(c)
    np.testing.assert_array_equal(again.outputs["y"], first.outputs["y"])
    assert again.version == first.version and again.outputs["y"].shape == (3, 4)
    assert batches_after == batches                              # no batch: no worker saw it
    assert (after["hits"], after["misses"]) == (cache["hits"] + 1, cache["misses"])
    assert c.stats()["models"]["m"]["replies"] >= 2


def test_another_version_never_hits(c):
    x = x_of(1.5)
    y1 = c.infer("m", {"x": x}, version="1")["y"]
    cache, batches = seen(c)
    y2 = c.infer("m", {"x": x}, version="2")["y"]
    after, batches_after = seen(c)
    np.testing.assert_array_equal(y1, x + 1)
    np.testing.assert_array_equal(y2, x + 2)                     # computed by 2, not 1's answer
    assert batches_after == batches + 1 and after["misses"] == cache["misses"] + 1 and after["hits"] == cache["hits"]


def test_a_model_without_a_cache_section_caches_nothing(c):
    x = x_of(2.5)
    _, batches = seen(c, "plain")
    for _ in range(2):
        np.testing.assert_array_equal(c.infer("plain", {"x": x})["y"], x + 1)
    cache, batches_after = seen(c, "plain")
    assert cache is None and batches_after == batches + 2


def test_http_and_compressed_replies_come_from_the_cache_too(c, broker):
    x = x_of(3.5)
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": x.ravel().tolist()}]})

    def post() -> list:
        req = urllib.request.Request(f"{broker.http}/v2/models/m/infer", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())["outputs"][0]["data"]
    first = post()
    cache, batches = seen(c)
    assert post() == first and c.infer("m", {"x": x}, compress=True)["y"].ravel().tolist() == first
    after, batches_after = seen(c)
    assert batches_after == batches and after["hits"] == cache["hits"] + 2


def test_a_hit_writes_into_the_callers_output_region(c):
    x = x_of(4.5, rows=2)
    with c.region(1 << 16, threshold=0, output_bytes=output_bytes_for([2 * 16])) as region:
        first = c.infer("m", {"x": x}, region=region)["y"]
        before, batches = c.stats()["regions"], seen(c)[1]
        again = c.infer("m", {"x": x}, region=region)["y"]
        after = c.stats()["regions"]
    np.testing.assert_array_equal(again, first)
    assert seen(c)[1] == batches and after["outputs"] == before["outputs"] + 1
    assert after["output_fallbacks"] == before["output_fallbacks"]


def test_a_pipelines_steps_hit_their_models_cache(c):
    x = x_of(5.5)
    y = c.infer("twice", {"x": x})["y"]
    cache, batches = seen(c)
    np.testing.assert_array_equal(c.infer("twice", {"x": x})["y"], y)
    np.testing.assert_array_equal(c.infer("m", {"x": x + 1})["y"], y)   # the second step's input
    after, batches_after = seen(c)
    assert batches_after == batches and after["hits"] == cache["hits"] + 3


def test_memory_stays_bounded_after_many_distinct_inputs(c, broker):
    n = 10 * ENTRIES

    async def flood() -> list:
        async with AsyncClient(broker.address) as ac:
            return await asyncio.gather(*(ac.infer("m", {"x": x_of(1000.0 + k)}) for k in range(n)))
    before, _ = seen(c)
    answers = asyncio.run(flood())
    after, _ = seen(c)
    assert len(answers) == n
    assert after["entries"] == ENTRIES and after["bytes"] == ENTRIES * ANSWER   # the older answers all went
    evicted = sum(after["evictions"].values()) - sum(before["evictions"].values())
    assert evicted == before["entries"] + n - ENTRIES and after["misses"] == before["misses"] + n


def test_metrics_show_the_cache(c, broker):
    c.infer("m", {"x": x_of(6.5)})
    with urllib.request.urlopen(f"{broker.http}/metrics", timeout=30) as r:
        text = r.read().decode()
    cache = c.status()["models"]["m"]["cache"]
    assert f'tgw_cache_hits_total{{model="m"}} {float(cache["hits"])}' in text
    assert f'tgw_cache_misses_total{{model="m"}} {float(cache["misses"])}' in text
    assert f'tgw_cache_entries{{model="m"}} {float(cache["entries"])}' in text
    assert f'tgw_cache_bytes{{model="m"}} {float(cache["bytes"])}' in text
    assert 'tgw_cache_evictions_total{model="m",reason="entries"}' in text and 'model="plain"' not in \
        "".join(line for line in text.splitlines() if line.startswith("tgw_cache_"))


def test_status_prints_the_cache(broker):
    r = subprocess.run([sys.executable, "-m", "tgw.broker", "status", "--address", broker.address],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert any(line.startswith("cache m: ") and " hits, " in line for line in r.stdout.splitlines()), r.stdout


def test_a_hot_swap_drops_the_retired_versions_answers_and_the_new_version_computes(c, broker):
    x, kept = x_of(7.5), x_of(8.5)
    np.testing.assert_array_equal(c.infer("m", {"x": x})["y"], x + 1)      # 1 serves unnamed requests
    c.infer("m", {"x": kept}, version="2")                                   # 2 keeps no weight: not drained
    assert c.infer_with_meta("m", {"x": x}).version == "1"
    before, batches = seen(c)
    reply = control(broker.address, LoadVersion(v=0, model="m", version="3", path=broker.paths[3]))
    assert "1 drained" in reply.message
    after, _ = seen(c)
    dropped = after["evictions"].get("invalidated", 0) - before["evictions"].get("invalidated", 0)
    assert dropped >= 1 and after["entries"] == before["entries"] - dropped
    assert after["bytes"] == after["entries"] * ANSWER
    new = c.infer_with_meta("m", {"x": x})
    np.testing.assert_array_equal(new.outputs["y"], x + 3)                   # computed by 3, not 1's answer
    assert new.version == "3" and seen(c)[1] == batches + 1
    hits = seen(c)[0]["hits"]
    np.testing.assert_array_equal(c.infer("m", {"x": kept}, version="2")["y"], kept + 2)   # 2's answers stay
    cache, batches_after = seen(c)
    assert cache["hits"] == hits + 1 and batches_after == batches + 1
