"""The load report (broker/observe/load.py) and the readiness rule (observe/status.py health) over
a real Broker assembled in-process (inproc sockets, no processes) with a real worker handle on a
real segment, under an injected clock: each figure from known counters, ORCA's text form as Envoy
reads it, and readiness through the phases and an open breaker."""
from __future__ import annotations

from contextlib import ExitStack

import pytest

from conftest import unloaded_model
from fake_clock import Clock
from rigs import assembled
from tgw.broker.config.load import parse_config
from tgw.broker.observe import status
from tgw.broker.observe.load import LoadReport, parse, quantile, text
from tgw.broker.core.broker import Broker
from tgw.broker.state.pending import Pending
from tgw.broker.state.pool import WorkerHandle
from tgw.shm.segment import Segment, new_name
from tgw.shm.wire import Heartbeat

ARENA = 1 << 20
IO = {"inputs": [{"name": "x", "dtype": "float32", "shape": [4]}],
      "outputs": [{"name": "y", "dtype": "float32", "shape": [4]}], "max_batch_size": 4}


@pytest.fixture
def worker():
    seg = Segment.create(new_name("ring"), 2 * ARENA)
    try:
        yield WorkerHandle(worker_id=0, device="cpu", cpus=[], segment=seg, input_bytes=ARENA, output_bytes=ARENA)
    finally:
        try:
            seg.close()
        finally:
            seg.unlink()


@pytest.fixture(autouse=True)
def _closes():
    """Every broker a test made is closed after it (their sockets, their loop)."""
    with ExitStack() as stack:
        _made.append(stack)
        yield
    _made.clear()


_made: list[ExitStack] = []


def make(tmp_path, worker, **models) -> tuple[Broker, Clock]:
    unloaded_model(tmp_path / "m.pt")
    decls = [{"name": name, "versions": [{"version": "1", "path": "m.pt"}], **IO, **extra}
             for name, extra in (models or {"m": {}}).items()]
    cfg = parse_config({"models": decls, "workers": {"devices": ["cpu"]}}, str(tmp_path))
    clock = Clock()
    return _made[-1].enter_context(assembled(cfg, clock=clock, roster=[worker])), clock


def serve(b: Broker, worker: WorkerHandle, *keys: str) -> None:
    worker.spawned(None)
    worker.became_ready(list(keys) or ["m:1"])
    b.start_serving()


def beat(sent: float, cpu_s: float, output_used: int = 0) -> Heartbeat:
    return Heartbeat(worker_id=0, pid=0, sent=sent, rss=1 << 20, cpu_s=cpu_s, fds=8, threads=2, batches=0,
                     output_used=output_used)


def answered(b: Broker, seconds: float) -> None:
    """One request answered with outputs after `seconds`, as admission's hooks see it."""
    p = Pending(client=b"c", req_id=1, model="m", version="1", rows=1, shape_key=(), tensors=[], outputs=["y"],
                deadline=1e9)
    p.arrived = 0.0
    b.metrics.finished([p], None, seconds)


def test_the_text_form_reads_back_as_envoy_reads_it():
    doc = {"cpu_utilization": 0.25, "mem_utilization": 0.5, "application_utilization": 1.5, "rps_fractional": 12.0,
           "named_metrics": {"queue_depth": 3, "inflight": 5, "p99_over_slo": 0.1, "memory_headroom": 0.75}}
    header = text(doc)
    assert header == ("TEXT cpu_utilization=0.25, mem_utilization=0.5, application_utilization=1.5, "
                      "rps_fractional=12.0, named_metrics.queue_depth=3, named_metrics.inflight=5, "
                      "named_metrics.p99_over_slo=0.1, named_metrics.memory_headroom=0.75")
    assert parse(header)["named_metrics.queue_depth"] == 3.0
    for bad in ("JSON {}", "TEXT cpu_utilization", "TEXT cpu_utilization=1, cpu_utilization=2",
                "TEXT cpu_utilization=-1", "TEXT cpu_utilization=inf", "TEXT eps_or_so=1", "TEXT named_metrics.=1"):
        with pytest.raises(ValueError):
            parse(bad)


def test_quantile_interpolates_in_its_bucket():
    bounds = (0.001, 0.002, 0.005)
    assert quantile([0, 100, 0, 0], 0.5, bounds) == pytest.approx(0.0015)   # halfway through (0.001, 0.002]
    assert quantile([100, 0, 0, 0], 0.99, bounds) == pytest.approx(0.00099)
    assert quantile([0, 0, 0, 5], 0.99, bounds) == 0.005                     # above every bound: the largest
    assert quantile([98, 0, 2, 0], 0.99, bounds) == pytest.approx(0.002 + 0.003 * 0.5)


def test_each_figure_from_known_counters(tmp_path, worker):
    b, clock = make(tmp_path, worker, m={"slo_p99_ms": 10.0, "adaptive_concurrency": False})
    report = LoadReport(b.view, b.metrics.latencies, cpus=2)
    report.refresh(clock.t)
    doc = report.doc   # no ready worker: no capacity, no room
    assert doc["application_utilization"] == 1.0 and doc["named_metrics"]["memory_headroom"] == 0.0
    serve(b, worker)
    worker.beat = beat(sent=1.0, cpu_s=1.0)
    t0 = clock.t = 200.0
    report.refresh(t0, force=True)
    b.stats.batch("m", 4, 500_000)            # half a second of compute in the window
    b.stats.models["m"].replies += 10
    for _ in range(50):
        answered(b, 0.003)                    # end to end: in the (2 ms, 5 ms] bucket
    worker.beat = beat(sent=2.0, cpu_s=2.0, output_used=ARENA // 2)   # one CPU second per second
    clock.t = t0 + 2.0
    report.refresh(clock.t)
    doc, named = report.doc, report.doc["named_metrics"]
    assert doc["application_utilization"] == 0.25          # 0.5 s / (2 s x 1 worker)
    assert doc["rps_fractional"] == 5.0                     # 10 answers in 2 s
    assert 0.5 <= doc["cpu_utilization"] < 1.0              # the worker's 1.0 over 2 CPUs, plus the broker's own
    assert named["memory_headroom"] == 0.75                 # input arena free, output arena half used
    assert doc["models"]["m"]["slo_key"] == "slo_p99_ms" and doc["models"]["m"]["p99_ms"] == pytest.approx(4.97)
    assert named["p99_over_slo"] == pytest.approx(0.497)
    assert named["queue_depth"] == 0 and named["inflight"] == 0 and doc["window_s"] == 2.0
    figures = parse(report.header)
    assert figures["application_utilization"] == 0.25 and figures["named_metrics.p99_over_slo"] == named["p99_over_slo"]
    before = report.header
    b.stats.models["m"].replies += 1000
    report.refresh(clock.t + 0.05)                          # under REFRESH_S: the same string
    assert report.header is before
    clock.t = t0 + 30.0
    report.refresh(clock.t)                                 # nothing answered since: back to 0
    assert report.doc["models"]["m"]["p99_ms"] is None and report.doc["named_metrics"]["p99_over_slo"] == 0.0


def test_ready_needs_the_serving_phase_and_every_model_servable(tmp_path, worker):
    b, clock = make(tmp_path, worker)
    report = LoadReport(b.view, b.metrics.latencies, cpus=1)
    assert not status.health(b.view).ready        # starting
    serve(b, worker)
    assert status.health(b.view).ready
    b.announce_stop()                              # the drain notice: served, not ready
    assert b.phase.is_serving() and not status.health(b.view).ready
    report.refresh(clock.t)
    assert report.draining and report.doc["phase"] == "draining"
    b.begin_stop()
    assert not b.phase.is_serving() and not status.health(b.view).ready


def test_an_open_breaker_makes_its_model_unservable_unless_its_fallback_serves(tmp_path, worker):
    breaker = {"min_requests": 3, "error_rate": 0.5, "cooldown_s": 5.0}
    b, clock = make(tmp_path, worker, m={"breaker": breaker}, other={})
    serve(b, worker, "m:1", "other:1")
    for _ in range(3):
        b.admission.breakers.get("m", "1").record(True, 0.01, clock.t)
    health = status.health(b.view)
    assert not health.ready and health.models == {"m": False, "other": True}
    clock.t += 5.0                                 # cooled down: the next request would be its probe
    assert status.health(b.view).ready

    b2, clock2 = make(tmp_path, worker, m={"breaker": {**breaker, "fallback": "other"}}, other={})
    b2.start_serving()
    for _ in range(3):
        b2.admission.breakers.get("m", "1").record(True, 0.01, clock2.t)
    assert status.health(b2.view).models["m"] is True   # open, but its fallback serves
