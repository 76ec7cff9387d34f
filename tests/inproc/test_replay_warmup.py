"""Replay warm-up in the worker's loader (workers/loader.py, workers/replay.py), in-process: a
LoadModel whose spec carries a Replay runs every replayed shape at every batch size, round after
round, until settled; max_s ends it unsettled yet loaded; a load without one is as before.

The model sleeps on its first call per shape (tgw.testing.slow_first, in this process), and counts
its calls per shape: what ran is observed in the model itself, not only in the report. No
assertion on a duration but the sleep's own lower bound."""
from __future__ import annotations

import pytest

from test_worker_loader import side  # noqa: F401 - the loader fixture
from tgw.testing.slow_first import IO, calls, save_slow_first
from tgw.shm.wire import IOSpec, ModelSpec, Replay, ReplayBatch

SLEEP_MS = 50.0
BATCHES = [ReplayBatch(rows=3, shapes=[[16]]), ReplayBatch(rows=1, shapes=[[32]]), ReplayBatch(rows=3, shapes=[[32]])]


@pytest.fixture
def slow(tmp_path) -> str:
    """A fresh file (a tag of its own: every shape is cold in this process)."""
    return save_slow_first(str(tmp_path / "slow.pt"), k=2, ms=SLEEP_MS)


def spec(path: str, replay: Replay | None = None) -> ModelSpec:
    io = {k: [IOSpec(**t) for t in v] for k, v in IO.items()}
    return ModelSpec(name="slow", version="1", path=path, warmup_batch_sizes=[1], replay=replay, **io)


def shapes(batches: list[ReplayBatch]) -> list[tuple[int, ...]]:
    return [(b.rows, *b.shapes[0]) for b in batches]


def test_every_replayed_shape_runs_at_every_batch_size_each_round_until_settled(side, slow):  # noqa: F811
    reply = side.load(spec(slow, Replay(batches=BATCHES, max_s=30.0)))
    report = reply.replay
    assert reply.error is None and report.settled and report.rounds >= 2, report
    assert shapes(report.covered) == shapes(BATCHES) and not report.payloads and report.failed == []
    assert report.p99_ms[0] >= SLEEP_MS   # the first round paid each shape's first call
    ran = calls(slow)
    assert {shape: ran[shape] for shape in [(3, 16), (1, 32), (3, 32)]} == {
        (3, 16): report.rounds, (1, 32): report.rounds, (3, 32): report.rounds}
    assert ran.pop((1, 8)) == 2   # the declared warm-up size first (once unmeasured, once measured), -1 dims at 8
    assert len(ran) == 3


def test_max_s_ends_the_replay_and_the_version_is_ready_all_the_same(side, slow):  # noqa: F811
    reply = side.load(spec(slow, Replay(batches=BATCHES, max_s=SLEEP_MS / 2000)))   # half a first call
    report = reply.replay
    assert reply.error is None and "slow:1" in side.runners
    assert not report.settled and report.rounds == 1 and shapes(report.covered) == [(3, 16)]
    assert calls(slow).get((1, 32)) is None   # the deadline passed during the first batch


def test_a_load_without_a_replay_runs_the_declared_sizes_only(side, slow):  # noqa: F811
    reply = side.load(spec(slow))
    assert reply.error is None and reply.replay is None
    assert calls(slow) == {(1, 8): 2}   # the declared size, once unmeasured and once measured (runner.warm_up)
