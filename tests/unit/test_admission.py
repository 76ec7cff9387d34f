"""Admission (broker/sched/admission.py) as a pure class under an injected clock: the order of the
scheduler's checks and what each refusal says. A real Config, registry, batcher and owed count;
no processes, no sockets."""
from __future__ import annotations

import pytest

from conftest import unloaded_model
from fake_clock import Clock
from rigs import tenants_of
from tgw.broker.sched.admission import Admission, Owed
from tgw.broker.sched.batcher import Batcher
from tgw.broker.sched.breaker import State
from tgw.broker.config.load import parse_config
from tgw.broker.models.registry import Registry
from tgw.broker.state.stats import Stats
from tgw.shm.errors import Code, TgwError
from tgw.shm.wire import PROTOCOL_VERSION, Infer, TensorMeta

X = {"name": "x", "dtype": "float32", "shape": [4]}


class Frame(bytes):
    @property
    def buffer(self) -> memoryview:
        return memoryview(self)


def model(name: str, **kw) -> dict:
    return {"name": name, "versions": [{"version": "1", "path": "m.pt"}], "inputs": [X],
            "outputs": [{"name": "y", "dtype": "float32", "shape": [4]}], "max_batch_size": 4, **kw}


def make(tmp_path, *models: dict, **top) -> tuple[Admission, Clock, list]:
    unloaded_model(tmp_path / "m.pt")
    cfg = parse_config({"models": list(models), **top}, str(tmp_path))
    clock, shed = Clock(), []
    registry = Registry(cfg.models)
    for entry in registry.models.values():
        for rec in entry.records.values():
            rec.seen = True
    batcher = Batcher(clock)
    stats = Stats()
    for m in cfg.models:
        batcher.add_model(m.name, m.max_batch_size, m.max_queue, levels=m.priority_levels)
        stats.model(m.name)
    adm = Admission(cfg.server, cfg.workers, cfg.models, tenants_of(cfg, clock), registry, batcher, stats,
                     Owed(cfg.server.max_inflight_per_client), clock,
                    shed=lambda p, err: (shed.append((p, err)), adm.finished(p, err.code.value, clock())))
    return adm, clock, shed


_ids = iter(range(1, 10 ** 9))


def infer(adm: Admission, model: str = "m", priority: int = 0, tenant: str | None = None, timeout_ms=None,
          client: bytes = b"c"):
    msg = Infer(v=PROTOCOL_VERSION, id=next(_ids), model=model, priority=priority, tenant=tenant,
                timeout_ms=timeout_ms, inputs=[TensorMeta(name="x", dtype="float32", shape=[1, 4])])
    return adm.admit(client, msg, [Frame(bytes(16))])


def code_of(fn) -> TgwError:
    with pytest.raises(TgwError) as info:
        fn()
    return info.value


def test_priority_out_of_range_is_invalid_argument(tmp_path):
    adm, _, _ = make(tmp_path, model("m", priority_levels=2))
    assert infer(adm, priority=1).priority == 1
    err = code_of(lambda: infer(adm, priority=2))
    assert err.code is Code.INVALID_ARGUMENT and err.details["priority_levels"] == 2


def test_deadline_that_no_batch_can_meet_is_refused_at_once(tmp_path):
    adm, _, _ = make(tmp_path, model("m"))
    adm.costs.observe("m", 0, 1, 20_000)                       # 20 ms per batch of one
    err = code_of(lambda: infer(adm, timeout_ms=10))
    assert err.code is Code.DEADLINE_EXCEEDED and err.details["predicted_ms"] == 20.0
    assert adm.batcher.queued("m") == 0
    infer(adm, timeout_ms=30)


def test_tenant_rate_limited_and_refunded_when_refused_later(tmp_path):
    adm, _, _ = make(tmp_path, model("m", max_queue=1), tenants={"t": {"rate": 1, "burst": 2}})
    infer(adm, tenant="t")
    err = code_of(lambda: infer(adm, tenant="t"))              # the queue is full: OVERLOADED ...
    assert err.code is Code.OVERLOADED
    assert adm.tenants.by_name["t"].inflight == 1             # ... and the token and slot came back
    adm.batcher.take_all()
    infer(adm, tenant="t")
    err = code_of(lambda: infer(adm, tenant="t"))
    assert err.code is Code.RATE_LIMITED and err.details["retry_after_ms"] == 1000


def test_required_tenant(tmp_path):
    adm, _, _ = make(tmp_path, model("m"), tenants={"t": {"rate": 100, "burst": 10}}, require_tenant=True)
    assert code_of(lambda: infer(adm, tenant="who")).code is Code.UNAUTHENTICATED
    assert code_of(lambda: infer(adm)).code is Code.UNAUTHENTICATED
    assert infer(adm, tenant="t").tenant.name == "t"


def test_adaptive_limit_reserves_room_for_higher_levels_and_sheds_the_lowest(tmp_path):
    adm, _, shed = make(tmp_path, model("m", slo_p99_ms=100))
    limit = adm.limits["m"]
    limit.limit = 6.0                # as if latency had set it: level 2 may fill 4, level 1 5, level 0 all 6
    lows = [infer(adm, priority=2) for _ in range(4)]
    err = code_of(lambda: infer(adm, priority=2))
    assert err.code is Code.OVERLOADED and err.details["reason"] == "adaptive_limit"
    infer(adm, priority=1)
    infer(adm, priority=0)
    assert limit.inflight == 6 and not shed
    high = infer(adm, priority=0)                              # full: the youngest level-2 request makes room
    assert [p for p, _ in shed] == [lows[3]] and shed[0][1].code is Code.OVERLOADED
    assert shed[0][1].details["reason"] == "adaptive_limit"
    assert limit.inflight == 6 and high in adm.batcher.queues["m"].items
    assert dict(adm.stats.models["m"].shed) == {2: 2}


def test_no_adaptive_limit_without_slo_or_when_switched_off(tmp_path):
    adm, _, _ = make(tmp_path, model("m"), model("n", slo_p99_ms=50, adaptive_concurrency=False))
    assert adm.limits == {}


def test_open_breaker_routes_to_the_fallback_or_answers_circuit_open(tmp_path):
    adm, clock, _ = make(tmp_path, model("m", breaker={"fallback": "backup", "cooldown_s": 2,
                                                     "memory_fraction": 0.5}),
                         model("backup"), model("alone", breaker={"memory_fraction": 0.5, "cooldown_s": 2}))
    adm.breakers.get("m", "1").memory(0.9, "worker0", clock())
    msg = Infer(v=PROTOCOL_VERSION, id=next(_ids), model="m", version="1",
                inputs=[TensorMeta(name="x", dtype="float32", shape=[1, 4])])
    p = adm.admit(b"c", msg, [Frame(bytes(16))])
    assert p.model == "backup" and adm.stats.models["m"].fallbacks == 1
    assert (msg.model, msg.version) == ("m", "1")               # the decoded message is never rewritten
    adm.breakers.get("alone", "1").memory(0.9, "worker0", clock())
    err = code_of(lambda: infer(adm, "alone"))
    assert err.code is Code.CIRCUIT_OPEN and err.http_status == 503 and err.retryable
    assert err.details["retry_after_ms"] == 2000
    clock.t += 2                                               # half-open: a probe goes to the model itself
    assert infer(adm, "alone").model == "alone"
    assert adm.breakers.get("alone", "1").state is State.HALF_OPEN


def test_fallback_with_another_signature_is_refused_at_start(tmp_path):
    other = model("backup")
    other["outputs"] = [{"name": "y", "dtype": "float32", "shape": [5]}]
    with pytest.raises(ValueError, match="declares different inputs or outputs"):
        make(tmp_path, model("m", breaker={"fallback": "backup"}), other)
    with pytest.raises(ValueError, match="not a configured model"):
        make(tmp_path, model("m", breaker={"fallback": "nope"}))


def test_finished_feeds_limit_tenant_and_breaker(tmp_path):
    adm, clock, _ = make(tmp_path, model("m", slo_p99_ms=100, breaker={"min_requests": 2, "error_rate": 0.5}),
                         tenants={"t": {"rate": 100, "burst": 10}})
    ps = [infer(adm, tenant="t") for _ in range(2)]
    for p in adm.batcher.next_batch("m", 1 << 20):
        p.dispatch(clock())
    clock.t += 0.01
    for p in ps:
        adm.finished(p, "MODEL_EXECUTION_ERROR", clock())
    assert adm.tenants.by_name["t"].inflight == 0 and adm.limits["m"].inflight == 0
    assert adm.breakers.get("m", "1").state is State.OPEN
