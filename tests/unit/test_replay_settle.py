"""The replay warm-up's rule (workers/replay.py), under a scripted clock: a round runs every
replayed batch once; the replay stops when two consecutive rounds' p99 agree within 20 % (or
1 ms), or when max_s has passed; a batch that raises is left out of later rounds, a sticky CUDA
error fails the load."""
from __future__ import annotations

import pytest
import torch

from tgw.shm.wire import IOSpec, ModelSpec, Replay, ReplayBatch
from tgw.workers.replay import batch_inputs, p99, settled, warm_replay


def test_p99_is_the_nearest_rank_so_a_small_round_reports_its_slowest_batch():
    assert p99([3.0, 1.0, 2.0]) == 3.0
    assert p99([float(k) for k in range(1, 101)]) == 99.0
    assert p99([float(k) for k in range(1, 201)]) == 198.0


@pytest.mark.parametrize("before, now, expected", [
    (10.0, 11.9, True), (11.9, 10.0, True), (10.0, 12.1, False), (200.0, 0.5, False),
    (0.2, 1.1, True),     # within 1 ms: sub-millisecond batches jitter more than 20 % by scheduling alone
    (0.2, 1.3, False),
])
def test_two_rounds_settle_within_20_percent_or_a_millisecond(before, now, expected):
    assert settled(before, now) is expected


class Scripted:
    """A runner whose n-th batch takes the seconds `script(n)` says, on its own clock; it raises
    for a batch of the rows in `fails` (the exception given)."""

    def __init__(self, script, fails: dict | None = None):
        self.spec = ModelSpec(name="m", version="2", path="", inputs=[IOSpec(name="x", dtype="float32", shape=[-1])],
                              outputs=[IOSpec(name="y", dtype="float32", shape=[-1])])
        self.device, self.key = torch.device("cpu"), "m:2"
        self.script, self.fails, self.now = script, fails or {}, 0.0
        self.calls: list[tuple[int, list]] = []   # (rows, input shape) of each batch run

    def clock(self) -> float:
        return self.now

    def run(self, inputs, rows: int):
        self.calls.append((rows, list(inputs[0].shape)))
        if rows in self.fails:
            raise self.fails[rows]
        self.now += self.script(len(self.calls) - 1)


BATCHES = [ReplayBatch(rows=1, shapes=[[16]]), ReplayBatch(rows=2, shapes=[[16]]), ReplayBatch(rows=4, shapes=[[32]])]


def replay(runner: Scripted, max_s: float = 30.0, batches=BATCHES):
    return warm_replay(runner, Replay(batches=batches, max_s=max_s), clock=runner.clock)


def test_it_runs_every_batch_each_round_and_stops_at_the_first_two_rounds_that_agree():
    # the first round pays the first calls (200 ms each), the next two agree (5 and 5.9 ms): no fourth
    runner = Scripted(lambda n: [0.2, 0.005, 0.0059, 0.001][n // 3])
    report = replay(runner)
    assert report.settled and report.rounds == 3 and len(runner.calls) == 9
    assert runner.calls[:3] == [(1, [1, 16]), (2, [2, 16]), (4, [4, 32])] == runner.calls[3:6] == runner.calls[6:]
    assert report.p99_ms == [200.0, 5.0, 5.9] and report.seconds == 0.633
    assert [(b.rows, b.shapes) for b in report.covered] == [(1, [[16]]), (2, [[16]]), (4, [[32]])]
    assert report.payloads is False and report.failed == []


def test_a_steady_model_settles_in_two_rounds():
    runner = Scripted(lambda n: 0.003)
    report = replay(runner)
    assert report.settled and report.rounds == 2 and report.p99_ms == [3.0, 3.0] and len(runner.calls) == 6


def test_max_s_ends_the_replay_unsettled_mid_round():
    runner = Scripted(lambda n: 1.0 + n)   # each batch slower than the last: never settles
    report = replay(runner, max_s=7.0)
    # the first round ends at 6 s; the second's first batch starts before 7 s, its second after
    assert not report.settled and len(runner.calls) == 4 and report.seconds == 10.0
    assert report.rounds == 2 and report.p99_ms == [3000.0, 4000.0] and len(report.covered) == 3


def test_a_batch_that_raises_is_left_out_of_later_rounds():
    runner = Scripted(lambda n: 0.003, fails={2: ValueError("shape refused by the model")})
    report = replay(runner)
    assert report.settled and [rows for rows, _ in runner.calls] == [1, 2, 4, 1, 4]
    assert report.failed == ["2 x [[16]]: ValueError: shape refused by the model"]
    assert [b.rows for b in report.covered] == [1, 4]


def test_a_sticky_cuda_error_fails_the_load():
    sticky = RuntimeError("CUDA error: an illegal memory access was encountered")
    with pytest.raises(RuntimeError, match="illegal memory access"):
        replay(Scripted(lambda n: 0.003, fails={2: sticky}))


def test_payloads_become_the_inputs_and_a_batch_without_them_is_zeros():
    runner = Scripted(lambda n: 0.0)
    data = torch.arange(6, dtype=torch.float32)
    given = batch_inputs(runner, ReplayBatch(rows=2, shapes=[[3]], payload=[data.numpy().tobytes()]))
    assert torch.equal(given[0], data.reshape(2, 3))
    zeros = batch_inputs(runner, ReplayBatch(rows=2, shapes=[[3]]))
    assert torch.equal(zeros[0], torch.zeros(2, 3))
    assert replay(runner, batches=[ReplayBatch(rows=2, shapes=[[3]], payload=[data.numpy().tobytes()])]).payloads
