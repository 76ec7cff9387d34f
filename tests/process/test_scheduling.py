"""The scheduler end to end (real broker, workers, sockets): one test per error code it answers -
OVERLOADED from the adaptive limit (lowest priority shed first), RATE_LIMITED and
UNAUTHENTICATED from tenants, DEADLINE_EXCEEDED from the cost model, CIRCUIT_OPEN and the
fallback from the breaker. Queues are formed behind a batch the test holds in a worker (the
test preload's gate op) and released by the test, so nothing depends on timing."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from conftest import EXT, base_config, in_flight, model_entry, wait_until
from tgw.client import Client, TgwError
from tgw.shm.errors import Code

WORKERS = {"devices": ["cpu"], "preload": [EXT], "input_arena_mb": 2, "output_arena_mb": 2}
IO = {"inputs": [{"name": "x", "dtype": "float32", "shape": [1]}],
      "outputs": [{"name": "y", "dtype": "float32", "shape": [1]}]}


@pytest.fixture(scope="module")
def gate(tmp_path_factory):
    """(model file, gate path): x = n > 0 holds the batch until the file `gate.n` exists."""
    import worker_ext
    d = tmp_path_factory.mktemp("gate")
    path = str(d / "gate.pt")
    torch.jit.script(worker_ext.Gate(str(d / "gate"))).save(path)
    return path, str(d / "gate")


def gate_entry(gate, **kw) -> dict:
    return {"name": "gate", "versions": [{"version": "1", "path": gate[0]}], **IO, "max_batch_size": 1, **kw}


def x(n: float) -> dict:
    return {"x": np.full((1, 1), n, np.float32)}


def call(c: Client, model: str, inputs: dict, **kw):
    try:
        return c.infer(model, inputs, **kw)
    except TgwError as err:
        return err


def in_thread(results: list, *args, **kw) -> threading.Thread:
    t = threading.Thread(target=lambda: results.append((kw.get("priority", 0), call(*args, **kw))))
    t.start()
    return t


def queued(c: Client, model: str) -> list[int]:
    return c.stats()["models"][model]["queued_by_priority"]


def test_adaptive_limit_sheds_lowest_priority_first(gate, make_broker):
    cfg = {"server": {"max_inflight_batches_per_worker": 1}, "workers": WORKERS,
           "models": [gate_entry(gate, slo_p99_ms=10_000, max_queue=64)]}
    b = make_broker(cfg)
    results: list = []
    with Client(b.address) as c:
        # the limit starts at 4 (x 1 row): level 0 may fill 4 places, level 1 three, level 2 two
        assert c.stats()["models"]["gate"]["concurrency"]["limit"] == 4
        threads = [in_thread(results, c, "gate", x(1))]          # held in the worker
        wait_until(lambda: in_flight(c) == 1, 30, "the held batch to reach the worker")
        for prio, want in ((2, [0, 0, 1]), (1, [0, 1, 1]), (0, [1, 1, 1]), (0, [2, 1, 0])):
            threads.append(in_thread(results, c, "gate", x(0), priority=prio))
            wait_until(lambda: queued(c, "gate") == want, 30, f"queued by level to become {want}")
            if prio == 2:                                         # level 2's share is full now
                refused = call(c, "gate", x(0), priority=2)
                assert isinstance(refused, TgwError) and refused.code is Code.OVERLOADED
                assert refused.details["reason"] == "adaptive_limit" and refused.retryable
        open(gate[1] + ".1", "w").close()
        for t in threads:
            t.join(60)
        stats = c.stats()["models"]["gate"]
    outcomes = sorted((prio, "ok" if isinstance(r, dict) else r.code.value) for prio, r in results)
    # the last level-0 request took the level-2 request's place: shed, answered OVERLOADED
    assert outcomes == [(0, "ok"), (0, "ok"), (0, "ok"), (1, "ok"), (2, "OVERLOADED")]
    assert stats["shed"] == {"2": 2} and stats["concurrency"]["inflight"] == 0


def test_tenant_rate_limit_and_default_tenant(model_files, make_broker):
    cfg = base_config(model_files, "mlp")
    cfg.update(tenants={"paid": {"rate": 1000, "burst": 1000, "max_inflight": 8},
                        "free": {"rate": 0.5, "burst": 2}}, default_tenant="free")
    b = make_broker(cfg)
    inputs = {"x": np.zeros((1, 256), np.float32)}
    with Client(b.address) as c:
        c.infer("mlp", inputs, tenant="free")
        c.infer("mlp", inputs, tenant="someone-unknown")          # the default tenant's bucket, shared
        err = call(c, "mlp", inputs)                               # no tenant: the default's too
        assert isinstance(err, TgwError) and err.code is Code.RATE_LIMITED and err.http_status == 429
        assert err.retryable and 1 <= err.details["retry_after_ms"] <= 2000 and err.details["tenant"] == "free"
        for _ in range(5):
            c.infer("mlp", inputs, tenant="paid")
        tenants = c.stats()["tenants"]
    assert tenants["free"]["limited"] == {"rate": 1, "inflight": 0} and tenants["free"]["admitted"] == 2
    assert tenants["paid"]["admitted"] == 5 and tenants["paid"]["inflight"] == 0


def test_tenant_required(model_files, make_broker):
    cfg = base_config(model_files, "mlp")
    cfg.update(tenants={"a": {"rate": 100, "burst": 10}}, require_tenant=True)
    b = make_broker(cfg)
    inputs = {"x": np.zeros((1, 256), np.float32)}
    with Client(b.address) as c:
        for tenant in ("b", None):
            err = call(c, "mlp", inputs, tenant=tenant)
            assert isinstance(err, TgwError) and err.code is Code.UNAUTHENTICATED
        assert c.infer("mlp", inputs, tenant="a")["y"].shape == (1, 10)


def test_deadline_no_batch_can_meet_is_answered_at_once(model_files, make_broker):
    b = make_broker(base_config(model_files, "spin", spin={"max_batch_size": 1}))
    rounds = {"x": np.full((1, 1), 600, np.float32)}                # about 0.3 s of compute
    with Client(b.address) as c:
        c.infer("spin", rounds)                                      # teaches the cost model
        model = wait_until(lambda: (s := c.stats()["models"]["spin"])["cost_model"]["compute_us"] and s, 30,
                           "the cost model to learn the batch time")
        predicted_us = model["cost_model"]["compute_us"]["worker0"]["1"]
        assert predicted_us > 10_000
        err = call(c, "spin", rounds, timeout=0.01)
        assert isinstance(err, TgwError) and err.code is Code.DEADLINE_EXCEEDED
        assert err.details["predicted_ms"] == pytest.approx(predicted_us / 1000, rel=0.01)
        after = c.stats()["models"]["spin"]
    assert after["rows"] == 1                                        # never computed


def test_breaker_opens_on_errors_routes_to_fallback_then_circuit_open(model_files, make_broker):
    cfg = base_config(model_files, "fails", fails={"max_batch_size": 1, "breaker": {
        "min_requests": 3, "error_rate": 0.5, "cooldown_s": 3600, "fallback": "backup"}})
    cfg["models"].append({**model_entry(model_files, "fails", max_batch_size=1), "name": "backup"})
    cfg["models"].append({**model_entry(model_files, "fails", max_batch_size=1), "name": "lone",
                          "breaker": {"min_requests": 3, "error_rate": 0.5, "cooldown_s": 3600}})
    b = make_broker(cfg)
    bad, good = {"x": -np.ones((1, 2), np.float32)}, {"x": np.ones((1, 2), np.float32)}
    with Client(b.address) as c:
        for model in ("fails", "lone"):
            for _ in range(3):
                err = call(c, model, bad)
                assert isinstance(err, TgwError) and err.code is Code.MODEL_EXECUTION_ERROR
        assert c.infer("fails", good)["y"][0, 0] == 2.0              # answered by the fallback
        err = call(c, "lone", good)
        assert isinstance(err, TgwError) and err.code is Code.CIRCUIT_OPEN and err.http_status == 503
        assert err.retryable and err.details["retry_after_ms"] > 3_000_000
        stats = c.stats()["models"]
    breaker = stats["fails"]["breakers"]["1"]
    assert breaker["state"] == "open" and "error rate" in breaker["reason"]
    assert [t["to"] for t in breaker["transitions"]] == ["open"]
    assert stats["fails"]["fallbacks"] == 1 and stats["backup"]["replies"] == 1 and stats["fails"]["replies"] == 0


def test_breaker_memory_trip_then_half_open_probes_close_it(model_files, make_broker):
    # any worker is over a memory fraction of 1e-6: the first heartbeat opens the breaker
    cfg = base_config(model_files, "mlp", mlp={"breaker": {"memory_fraction": 0.000001, "cooldown_s": 0.2,
                                                           "probes": 1}},
                      supervisor={"heartbeat_s": 0.2, "hang_timeout_s": 10})
    b = make_broker(cfg)
    inputs = {"x": np.zeros((1, 256), np.float32)}
    with Client(b.address) as c:
        wait_until(lambda: c.stats()["models"]["mlp"]["breakers"]["1"]["transitions"], 30,
                   "a heartbeat to trip the memory breaker")
        # it reopens on every heartbeat while the worker stays over: some calls are refused, some probe
        seen = set()
        wait_until(lambda: seen.add("ok" if isinstance(r := call(c, "mlp", inputs), dict) else r.code.value)
                   or {"ok", "CIRCUIT_OPEN"} <= seen, 60, "both a probe answered and a CIRCUIT_OPEN")
        transitions = [t["to"] for t in c.stats()["models"]["mlp"]["breakers"]["1"]["transitions"]]
    assert transitions[:2] == ["open", "half_open"]
