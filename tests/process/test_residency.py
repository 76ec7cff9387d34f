"""On-demand residency under a memory budget: the eviction rule (broker/models/residency.py) on real
worker handles, then end to end: three on-demand models, a budget that fits two, round robin.

The end-to-end figures (loads, evictions, cold-request latency) are printed; the rules are
asserted: no failed request, evictions in LRU order, never over the budget by more than one
model, the cold request's MODEL_NOT_READY hint, a model that fails to load answered with why."""
from __future__ import annotations

import tempfile

import numpy as np
import pytest

from tgw.testing.child import BrokerProc
from tgw.testing.lifecycle import model_decl, residency, save_add_model
from tgw.broker.state.pool import WorkerHandle
from tgw.broker.models.residency import Residency, budget_bytes
from tgw.broker.config.schema import VersionDecl
from tgw.broker.state.versions import VersionRecord, VersionState
from tgw.client import Client
from tgw.shm.errors import Code, TgwError
from tgw.shm.segment import Segment, new_name

MIB = 1 << 20


# ---- the rule ----------------------------------------------------------------------------------

@pytest.fixture
def worker():
    seg = Segment.create(new_name("ring"), 2 * MIB)
    try:
        w = WorkerHandle(worker_id=0, device="cpu", cpus=[], segment=seg, input_bytes=MIB, output_bytes=MIB)
        w.spawned(None)
        w.became_ready([])
        yield w
    finally:
        seg.close()
        seg.unlink()


def records(*names: str, on_demand: bool = True) -> dict[str, VersionRecord]:
    out = {}
    for n in names:
        rec = VersionRecord(n, VersionDecl(version="1", path=f"/m/{n}.pt"), VersionState.READY, on_demand)
        rec.bytes = 10 * MIB
        out[rec.key] = rec
    return out


def hold(w: WorkerHandle, recs: dict, key: str, used_at: float, on_demand: bool = True) -> None:
    w.loaded(key, recs[key].bytes, None, now=used_at)
    if on_demand:
        w.want(key)


def test_room_evicts_the_least_recently_used_idle_model_first(worker):
    recs = records("a", "b", "c", "d")
    res = Residency(recs.get, lambda *a, **k: None)
    worker.budgeted(30 * MIB)
    hold(worker, recs, "a:1", used_at=1.0)
    hold(worker, recs, "b:1", used_at=2.0)
    hold(worker, recs, "c:1", used_at=3.0)
    recs["a:1"].active = 1                  # busy: requests admitted and unanswered
    assert not res.room(worker, "d:1")      # full: one must go, and the load waits for it
    assert worker.holding.evicting == {"b:1"}       # the least recently used idle one, not busy "a"
    assert recs["b:1"].evictions == 1 and "b:1" not in worker.holding.wanted
    assert not res.room(worker, "d:1") and worker.holding.evicting == {"b:1"}   # no second victim for the same room


def test_a_busy_model_is_evicted_only_when_none_is_idle(worker):
    recs = records("a", "b", "c")
    res = Residency(recs.get, lambda *a, **k: None)
    worker.budgeted(20 * MIB)
    hold(worker, recs, "a:1", used_at=2.0)
    hold(worker, recs, "b:1", used_at=1.0)
    recs["a:1"].active = recs["b:1"].active = 3
    assert not res.room(worker, "c:1") and worker.holding.evicting == {"b:1"}


def test_memory_on_its_way_back_is_waited_for(worker):
    recs = records("a", "b")
    res = Residency(recs.get, lambda *a, **k: None)
    worker.budgeted(15 * MIB)
    worker.holding.unloading.add("a:1")
    worker.sizes["a:1"] = 10 * MIB
    assert not res.room(worker, "b:1") and not worker.holding.evicting
    worker.holding.unloading.clear()
    worker.sizes.clear()
    assert res.room(worker, "b:1")


def test_beside_always_resident_models_one_model_may_exceed_the_budget(worker):
    always, demand = records("big", on_demand=False), records("x")
    res = Residency({**always, **demand}.get, lambda *a, **k: None)
    worker.budgeted(15 * MIB)
    hold(worker, always, "big:1", used_at=1.0, on_demand=False)
    assert res.room(worker, "x:1")          # nothing evictable: it loads, over by at most itself
    assert not worker.holding.evicting


def test_budget_is_bytes_or_a_share_of_the_device():
    assert budget_bytes(None, "cpu") is None
    assert budget_bytes(3 * MIB, "cpu") == 3 * MIB
    half = budget_bytes(0.5, "cpu")
    import psutil
    assert abs(half - psutil.virtual_memory().total / 2) <= 1
    assert budget_bytes(0.25, "cuda:0", 80 << 30) == 20 << 30     # the GPU's size, from its worker's hello
    assert budget_bytes(0.25, "cuda:0") is None                   # before the hello: not known yet
    assert budget_bytes(3 * MIB, "cuda:0") == 3 * MIB


def test_a_gpu_workers_budget_comes_from_the_size_its_hello_gives(worker):
    from types import SimpleNamespace

    from tgw.broker.fleet.handshake import Handshake
    from tgw.shm.wire import PROTOCOL_VERSION, WorkerHello
    worker.device = "cuda:0"
    no_models = SimpleNamespace(startup_specs=lambda: [])   # the registry's one call here
    shake = Handshake(no_models, budget=lambda w: budget_bytes(0.5, w.device, w.device_memory))
    shake.hello(worker, WorkerHello(v=PROTOCOL_VERSION, worker_id=0, pid=7, device_uuid="GPU-x",
                                    device_memory=80 << 30), 0.0)
    assert (worker.device_memory, worker.budget) == (80 << 30, 40 << 30)


# ---- end to end ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def on_demand_broker(tmp_path_factory):
    d = tmp_path_factory.mktemp("on_demand")
    paths = {n: save_add_model(str(d / f"{n}.pt"), k, pad_floats=2 << 20) for k, n in enumerate("abc", 1)}
    import torch

    class Wrong(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[:, :2]
    torch.jit.save(torch.jit.script(Wrong()), str(d / "wrong.pt"))
    models = [model_decl(n, [("1", p)], residency="on_demand") for n, p in paths.items()]
    models.append(model_decl("bad", [("1", str(d / "wrong.pt"))], residency="on_demand"))
    models.append(model_decl("resident", [("1", save_add_model(str(d / "r.pt"), 5))]))
    cfg = {"model_roots": [str(d)], "models": models,
           "workers": {"devices": ["cpu"], "input_arena_mb": 4, "output_arena_mb": 4,
                       "max_model_memory": 20 * MIB}}   # two of the 8 MiB models fit, not three
    b = BrokerProc(cfg, tempfile.mkdtemp(prefix="tgwd-", dir="/tmp")).start()
    yield b
    assert b.stop() == 0, b.output()


def test_round_robin_over_more_models_than_fit_evicts_in_lru_order(on_demand_broker):
    r = residency(on_demand_broker.address, ["a", "b", "c"], rounds=3)
    print("residency:", r)
    assert r["failed"] == {}
    assert r["loads"] == list("abcabcabc")           # every request after the first two is cold ...
    # ... and evicts the least recently used; counted by measured footprints (RSS, a few MiB of
    # noise beside 8 MiB models) the last load may evict one more
    assert r["evictions"] == list("abcabcabc")[:len(r["evictions"])] and len(r["evictions"]) >= 7
    assert all(over <= 8 * MIB + 64 for over in r["over_budget_bytes"])   # at most one model over
    with Client(on_demand_broker.address) as c:
        stats = c.stats()["models"]
        assert stats["a"]["versions"]["1"]["loads"] == 3 and stats["a"]["versions"]["1"]["evictions"] == 3
        assert stats["resident"]["versions"]["1"]["evictions"] == 0
        assert sum(e["event"] == "evict" for e in c.status()["events"]) > 0


def test_a_cold_request_its_load_would_outlast_is_told_when_to_retry(on_demand_broker):
    residency(on_demand_broker.address, ["a", "b", "c"], rounds=1)   # "a" is evicted now, its load time known
    with Client(on_demand_broker.address) as c, pytest.raises(TgwError) as info:
        c.infer("a", {"x": np.zeros((1, 4), np.float32)}, timeout=0.001)
    err = info.value
    assert err.code is Code.MODEL_NOT_READY and err.retryable and err.details["reason"] == "loading"
    assert err.details["retry_after_ms"] >= 1 and "longer timeout" in err.message


def test_an_on_demand_model_that_fails_to_load_answers_why(on_demand_broker):
    with Client(on_demand_broker.address) as c, pytest.raises(TgwError) as info:
        c.infer("bad", {"x": np.zeros((1, 4), np.float32)}, timeout=30)
    err = info.value
    assert err.code is Code.MODEL_NOT_READY and err.details["reason"] == "load_failed" and not err.retryable
    assert "warmup" in err.message
    # asked again at once: refused with the same reason, without paying for another failing load
    with Client(on_demand_broker.address) as c:
        with pytest.raises(TgwError) as again:
            c.infer("bad", {"x": np.zeros((1, 4), np.float32)}, timeout=30)
        assert again.value.details["reason"] == "load_failed" and "warmup" in again.value.message
        assert 0 < again.value.details["retry_after_ms"] <= 10_000
        failures = [e for e in c.status()["events"] if e["event"] == "load_failed" and e["model"] == "bad"]
    assert len(failures) == 1
