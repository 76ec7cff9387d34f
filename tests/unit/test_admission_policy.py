"""The scheduler's pure policy classes under an injected clock: the cost model, tenants' token
buckets, the adaptive concurrency limit and the circuit breaker. No processes."""
from __future__ import annotations

import pytest

from fake_clock import Clock
from tgw.broker.sched.breaker import Breaker, State
from tgw.broker.sched.concurrency import WINDOW_S, AdaptiveLimit
from tgw.broker.sched.costmodel import CostModel
from tgw.broker.config.schema import BreakerDecl, TenantDecl
from tgw.broker.sched.tenants import Tenants, TokenBucket
from tgw.shm.errors import Code, TgwError


# ---- cost model -----------------------------------------------------------------------------

def test_cost_model_ewma_and_prediction_between_and_beyond_sizes():
    c = CostModel()
    assert c.predict("m", 4) == 0.0                       # nothing known: no waiting on its account
    c.observe("m", 0, 1, 1000)
    c.observe("m", 0, 8, 4000)
    assert c.predict("m", 1, 0) == pytest.approx(0.001)
    assert c.predict("m", 4, 0) == pytest.approx(0.001 + 0.003 * 3 / 7)   # linear between seen sizes
    assert c.predict("m", 16, 0) == pytest.approx(0.008)                # per-row cost of the largest
    c.observe("m", 0, 1, 2000)
    assert c.predict("m", 1, 0) == pytest.approx(0.001 + 0.2 * 0.001)    # EWMA, not the last sample
    c.observe("m", 1, 1, 9000)                                           # a slower worker
    assert c.predict("m", 1) == pytest.approx(0.009)                     # unknown worker: the slowest
    assert c.as_dict("m")["compute_us"]["worker0"]["8"] == 4000.0


# ---- tenants --------------------------------------------------------------------------------

def test_token_bucket_rate_burst_and_retry_after():
    clock = Clock()
    bucket = TokenBucket(rate=10, burst=2, clock=clock)
    assert bucket.take() == 0 and bucket.take() == 0
    assert bucket.take() == pytest.approx(0.1)            # empty: a token in 100 ms
    clock.t += 0.05
    assert bucket.take() == pytest.approx(0.05)
    clock.t += 10                                          # refills only up to the burst
    assert [bucket.take() for _ in range(3)][2] > 0


def tenants(clock, **kw) -> Tenants:
    decls = {"gold": TenantDecl(rate=1000, burst=1000, max_inflight=2), "free": TenantDecl(rate=1, burst=1)}
    return Tenants(decls, kw.get("default"), kw.get("required", False), clock)


def test_tenant_rate_limited_with_retry_after():
    clock = Clock()
    ts = tenants(clock)
    free = ts.resolve("free")
    ts.admit(free, clock())
    with pytest.raises(TgwError) as info:
        ts.admit(free, clock())
    err = info.value
    assert err.code is Code.RATE_LIMITED and err.http_status == 429 and err.retryable
    assert err.details["retry_after_ms"] == 1000 and err.details["reason"] == "tenant_rate"
    assert free.limited["rate"] == 1 and free.inflight == 1


def test_tenant_max_inflight_and_release():
    clock = Clock()
    ts = tenants(clock)
    gold = ts.resolve("gold")
    ts.admit(gold, clock())
    ts.admit(gold, clock())
    with pytest.raises(TgwError) as info:
        ts.admit(gold, clock(), slot_free_in=0.02)
    assert info.value.details["reason"] == "tenant_inflight" and info.value.details["retry_after_ms"] == 20
    gold.inflight -= 1                                     # one answered (Admission.finished)
    ts.admit(gold, clock())


def test_unknown_tenant_gets_the_default_or_is_refused_when_required():
    clock = Clock()
    assert tenants(clock).resolve("nobody") is None        # no default: not limited by tenant
    with_default = tenants(clock, default="free")
    assert with_default.resolve("nobody") is with_default.by_name["free"]   # shares its bucket
    assert with_default.resolve(None) is with_default.by_name["free"]
    strict = tenants(clock, required=True)
    for name in ("nobody", None):
        with pytest.raises(TgwError) as info:
            strict.resolve(name)
        assert info.value.code is Code.UNAUTHENTICATED
    assert strict.resolve("gold").name == "gold"


def test_unadmit_returns_the_token_and_the_slot():
    clock = Clock()
    ts = tenants(clock)
    free = ts.resolve("free")
    ts.admit(free, clock())
    ts.unadmit(free)                                       # refused later (e.g. OVERLOADED): not charged
    assert free.inflight == 0 and free.bucket.tokens == 1  # its slot free and its token back
    ts.admit(free, clock())                                # the same instant: granted on that token
    assert free.inflight == 1 and free.limited == {"rate": 0, "inflight": 0}


# ---- adaptive concurrency -------------------------------------------------------------------

def feed(limit: AdaptiveLimit, clock: Clock, latency: float, windows: int, bind: bool = True) -> None:
    for _ in range(windows):
        if bind:
            limit.inflight = int(limit.limit)
            assert limit.full()
        for _ in range(10):
            limit.record(latency, clock())
        clock.t += WINDOW_S


def test_limit_shrinks_when_p99_is_over_the_slo_and_never_below_a_batch():
    clock = Clock()
    limit = AdaptiveLimit(slo_s=0.1, floor=8, ceiling=1000, initial=100, now=clock())
    feed(limit, clock, latency=0.2, windows=1)
    feed(limit, clock, latency=0.2, windows=1)
    assert limit.limit == pytest.approx(50)                # x slo/p99 = halved (at most halving)
    feed(limit, clock, latency=1.0, windows=10)
    assert limit.limit == 8 and limit.decreases >= 2


def test_limit_grows_only_while_binding_and_well_under_the_slo():
    clock = Clock()
    limit = AdaptiveLimit(slo_s=0.1, floor=8, ceiling=1000, initial=32, now=clock())
    feed(limit, clock, latency=0.01, windows=5, bind=False)
    assert limit.limit == 32                               # not reached: no evidence more would help
    feed(limit, clock, latency=0.09, windows=5)
    assert limit.limit == 32                               # between 80 % and 100 % of the slo: hold
    feed(limit, clock, latency=0.01, windows=5)
    assert limit.limit > 32 and limit.increases >= 4


def test_limit_full_counts_inflight():
    limit = AdaptiveLimit(slo_s=0.1, floor=2, ceiling=10, initial=3)
    limit.inflight = 2
    assert not limit.full()
    limit.inflight = 3
    assert limit.full()


# ---- circuit breaker ------------------------------------------------------------------------

def breaker(clock, slo_s=None, **kw) -> Breaker:
    decl = BreakerDecl(**{"min_requests": 10, "error_rate": 0.5, "window_s": 10, "cooldown_s": 5, "probes": 2,
                          **kw})
    return Breaker("m:1", decl, slo_s, clock())


def test_breaker_opens_on_error_rate_only_past_min_requests():
    clock = Clock()
    b = breaker(clock)
    for _ in range(8):
        b.record(True, 0.01, clock())                      # 8 of 8 failed, but fewer than min_requests
    assert b.state is State.CLOSED
    b.record(False, 0.01, clock())
    b.record(True, 0.01, clock())                          # 9 failed of 10
    assert b.state is State.OPEN and "error rate" in b.reason
    assert not b.allow(clock()) and b.retry_after_s(clock()) == pytest.approx(5)


def test_breaker_error_window_slides():
    clock = Clock()
    b = breaker(clock)
    for _ in range(9):
        b.record(True, 0.01, clock())
    clock.t += 11                                           # those failures left the window
    for _ in range(9):
        b.record(False, 0.01, clock())
    b.record(True, 0.01, clock())
    assert b.state is State.CLOSED


def test_breaker_half_open_probes_close_it_or_reopen_it():
    clock = Clock()
    b = breaker(clock)
    b.memory(0.99, "worker0", clock())                     # no memory_fraction configured: ignored
    assert b.state is State.CLOSED
    b = breaker(clock, memory_fraction=0.5)
    b.memory(0.6, "worker0", clock())
    assert b.state is State.OPEN
    clock.t += 5
    assert b.allow(clock()) and b.allow(clock())           # two probes ...
    assert not b.allow(clock())                             # ... and no more while they run
    assert b.state is State.HALF_OPEN
    b.record(False, 0.01, clock())
    b.record(True, 0.01, clock())                           # a probe failed: open again
    assert b.state is State.OPEN
    clock.t += 5
    assert b.allow(clock()) and b.allow(clock())
    b.record(False, 0.01, clock())
    b.record(False, 0.01, clock())
    assert b.state is State.CLOSED
    assert [t["to"] for t in b.as_dict(clock())["transitions"]] == ["open", "half_open", "open", "half_open",
                                                                     "closed"]


def test_breaker_reprobes_when_probes_never_come_back():
    clock = Clock()
    b = breaker(clock, memory_fraction=0.5)
    b.memory(0.9, "worker0", clock())
    clock.t += 5
    assert b.allow(clock()) and b.allow(clock()) and not b.allow(clock())
    clock.t += 5                                            # they expired in the queue: probe again
    assert b.allow(clock())


def test_breaker_opens_on_compute_p99_over_factor_times_slo():
    clock = Clock()
    b = breaker(clock, slo_s=0.010, p99_factor=2.0)        # trips over 20 ms
    for _ in range(20):
        b.record(False, 0.015, clock())
    b.check(clock())
    assert b.state is State.CLOSED
    for _ in range(20):
        b.record(False, 0.050, clock())
    b.check(clock())
    assert b.state is State.OPEN and "p99" in b.reason
