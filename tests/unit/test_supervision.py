"""Supervision without processes: hang verdicts from heartbeats, poison requests retried alone
then given up, the crash-loop guard (admission refusing while every worker is benched:
tests/inproc/test_broker_core.py). Times are passed in; nothing here waits."""
from __future__ import annotations

import logging

import pytest

from tgw.broker.sched.batcher import Batcher, Pending
from tgw.broker.config.load import CrashLoopDecl, LeakDecl, SupervisorDecl, WorkersDecl
from tgw.broker.fleet.leaks import LeakJudge
from tgw.broker.fleet.handshake import Handshake
from tgw.broker.sched.costmodel import CostModel
from tgw.broker.fleet.hangs import HangJudge
from tgw.broker.state.pool import Inflight, WorkerHandle
from tgw.broker.fleet.supervisor import Supervisor
from tgw.shm.segment import Segment, new_name
from tgw.shm.wire import Heartbeat

DECL = SupervisorDecl(heartbeat_s=1.0, hang_timeout_s=5.0, batch_timeout_s=10.0, batch_timeout_factor=4.0)


@pytest.fixture
def worker():
    seg = Segment.create(new_name("ring"), 128 << 10)
    w = WorkerHandle(0, "cpu", [], seg, 64 << 10, 64 << 10)
    yield w
    w.segment.close()
    w.segment.unlink()


def pending(req_id: int, model: str = "m") -> Pending:
    return Pending(client=b"\x01c", req_id=req_id, model=model, version="1", rows=1, shape_key=(),
                   tensors=[b"x" * 8], outputs=["y"], deadline=1e9)


def beat(batch_id=None, since=0.0) -> Heartbeat:
    return Heartbeat(worker_id=0, pid=1, sent=0.0, rss=1, cpu_s=0.0, fds=1, threads=1, batches=0,
                     batch_id=batch_id, batch_since=since)


def test_silent_worker_is_judged_hung(worker):
    judge = HangJudge(DECL, CostModel(), start_timeout_s=30.0)
    worker.spawned(None, now=100.0)
    assert judge.hung([worker], 129.0) == []                  # importing torch: judged by the start limit
    (w, reason), = judge.hung([worker], 131.0)
    assert w is worker and "no first heartbeat 31.0 s after it started" in reason
    worker.beat, worker.beat_at = beat(), 130.5               # a beat arrives: fine again ...
    assert judge.hung([worker], 135.0) == []
    (w, reason), = judge.hung([worker], 136.0)                # ... until it falls silent
    assert "no heartbeat for 5.5 s" in reason


def test_batch_running_past_its_limit_is_judged_hung(worker):
    costs = CostModel()
    costs.observe("m", 0, 1, 5_000_000)                       # a batch of 1 takes 5 s: limit 4 x 5 = 20 s
    judge = HangJudge(DECL, costs, start_timeout_s=30.0)
    assert judge.batch_limit_s("m", 1, 0) == 20.0 and judge.batch_limit_s("other") == 10.0
    assert judge.batch_limit_s("m", 2, 0) == 40.0             # twice the rows: twice the time allowed
    worker.spawned(None, now=0.0)
    worker.became_ready(["m:1"], now=0.0)
    worker.inflight[7] = Inflight(7, "m", "m:1", [pending(1)], 0, 1)
    worker.beat, worker.beat_at = beat(batch_id=7, since=100.0), 119.0
    assert judge.hung([worker], 119.5) == []
    worker.beat_at = 121.0
    (w, reason), = judge.hung([worker], 121.0)
    assert "batch 7 of m computing for 21.0 s (limit 20.0 s)" in reason
    worker.kill_reason = reason                               # already being killed: judged once
    assert judge.hung([worker], 130.0) == []


def test_retried_requests_run_alone_and_others_do_not_join_them():
    b = Batcher()
    b.add_model("m", max_batch_size=8, max_queue=16)
    first, retried, third = pending(1), pending(2), pending(3)
    retried.alone = True
    for p in (first, retried, third):
        b.push(p)
    assert [p.req_id for p in b.next_batch("m", 1 << 20)] == [1, 3]
    assert [p.req_id for p in b.next_batch("m", 1 << 20)] == [2]


def test_lost_requests_are_retried_once_alone_then_given_up(worker, caplog):
    batch = [pending(1), pending(2)]
    worker.inflight[1] = Inflight(1, "m", "m:1", batch, 0, 2)
    again, gone = Handshake.lost(worker, retry=True)
    assert again == batch and gone == [] and all(p.alone and p.attempts == 1 for p in batch)
    worker.inflight[2] = Inflight(2, "m", "m:1", [batch[0]], 0, 1)   # the poison one kills a second worker
    with caplog.at_level(logging.ERROR, logger="tgw.broker"):
        again, gone = Handshake.lost(worker, retry=True)
    assert again == [] and gone == [batch[0]]
    assert "two worker deaths" in caplog.text and "model=m version=1 rows=1" in caplog.text


def test_crash_loop_benches_the_worker_until_it_starts_well():
    watch = SupervisorDecl(crash_loop=CrashLoopDecl(deaths=3, window_s=60.0, backoff_s=45.0))
    sup = Supervisor(WorkersDecl(devices=["cpu"], input_arena_mb=1, output_arena_mb=1), watch, "ipc:///nowhere")
    sup.prepare()
    w = sup.workers[0]
    try:
        for death in range(3):
            w.spawned(None)
            w.exited()
            w.last_death = "killed by SIGSEGV"
            sup.schedule_restart(w)
            assert bool(w.benched) == (death == 2)
        assert "died 3 times in 60 s (last: killed by SIGSEGV)" in w.benched and w.restarts == 3
        w.spawned(None)
        w.became_ready([])
        sup.reap()                                            # a successful start forgives it
        assert w.benched == ""
    finally:
        sup.stop()


def test_a_suspect_batch_runs_on_a_worker_holding_nothing_else(worker):
    worker.spawned(None)
    worker.became_ready(["m:1"])
    assert worker.can_take("m:1", 2, suspect=True)
    normal, retried = pending(1), pending(2)
    retried.alone = True
    worker.inflight[1] = Inflight(1, "m", "m:1", [normal], 0, 1)
    assert worker.can_take("m:1", 2) and not worker.can_take("m:1", 2, suspect=True)
    worker.inflight = {2: Inflight(2, "m", "m:1", [retried], 0, 1)}
    assert not worker.can_take("m:1", 2) and not worker.can_take("m:1", 2, suspect=True)


def _leak_beats(judge: LeakJudge, points) -> str:
    why = ""
    for i, (batches, rss_mib) in enumerate(points):
        b = beat()
        b.batches, b.rss = batches, rss_mib << 20
        why = judge.record(b"w0.0", b, float(i))
    return why


def test_leak_judge_needs_a_sustained_rise_over_enough_batches():
    judge = LeakJudge(LeakDecl(window_s=60.0, min_samples=5, mib_per_1k_batches=50.0))
    assert _leak_beats(judge, [(0, 100), (10, 300), (20, 300), (30, 301), (40, 300)]) == ""   # too few batches
    judge.forget(b"w0.0")
    flat = [(i * 50, 300 + (i % 2)) for i in range(10)]
    assert _leak_beats(judge, flat) == ""                                                   # noise, no trend
    judge.forget(b"w0.0")
    why = _leak_beats(judge, [(i * 50, 300 + 5 * i) for i in range(10)])                    # 100 MiB / 1k batches
    assert why.startswith("RSS rising 100.0 MiB per 1,000 batches")
    ceiling = LeakJudge(LeakDecl(rss_ceiling_mb=512))
    assert _leak_beats(ceiling, [(0, 600)]) == "RSS 600 MiB is over rss_ceiling_mb 512"
    assert LeakJudge(LeakDecl()).record(b"w", beat(), 0.0) == ""                            # off by default
