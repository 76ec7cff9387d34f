"""The crash-loop guard counts only workers that cannot get going (fleet/restarts.py).

A worker SIGKILLed while serving (what an OOM killer does under load) is restarted at once
every time and its model stays served; one that dies before ready trips the guard; the delays
between starts of a worker dying before ready double from a short first one. The supervisor
cases pass times in; the broker case waits on its status, and kills only PIDs it reports."""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from conftest import Load, base_config, wait_until
from tgw.broker.config.load import CrashLoopDecl, SupervisorDecl, WorkersDecl
from tgw.broker.fleet.restarts import FIRST_DELAY_S, READY_GRACE_S, backoff_s
from tgw.broker.fleet.supervisor import Supervisor
from tgw.client import Client

X = np.ones((1, 256), np.float32)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


CLOCK = Clock()


@pytest.fixture
def sup():
    watch = SupervisorDecl(crash_loop=CrashLoopDecl(deaths=5, window_s=60.0, backoff_s=30.0))
    s = Supervisor(WorkersDecl(devices=["cpu"], input_arena_mb=1, output_arena_mb=1), watch, "ipc:///nowhere",
                   clock=CLOCK)
    s.prepare()
    yield s
    s.stop()


def die(sup: Supervisor, ready_for: float | None = None) -> float:
    """One life of worker 0 (no process): spawned, ready for `ready_for` s (None: never), killed;
    returns the delay the supervisor set before its next start, read from its restart time."""
    w, clock = sup.workers[0], CLOCK
    w.spawned(None, clock())
    sup.restarts.spawned(w.worker_id)
    if ready_for is not None:
        w.became_ready([], clock())
        sup.ready(w)
        clock.t += ready_for
    w.exited()
    w.last_death = "killed by SIGKILL"
    sup.schedule_restart(w)
    return sup.restart_at(w) - clock()


def test_backoff_doubles_from_a_short_first_delay_to_the_cap():
    assert [backoff_s(n, 30.0) for n in range(1, 10)] == [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8, 25.6]
    assert backoff_s(10, 30.0) == backoff_s(40, 30.0) == 30.0
    assert backoff_s(0, 30.0) == pytest.approx(FIRST_DELAY_S)   # after a life that served


def test_deaths_before_ready_back_off_then_trip_the_guard(sup):
    w = sup.workers[0]
    delays = []
    for _ in range(5):
        delays.append(die(sup))
        CLOCK.t += delays[-1] + 2.0   # the start that follows fails 2 s in
    assert delays[:4] == pytest.approx([0.1, 0.2, 0.4, 0.8])   # each wait twice the one before
    assert delays[4] == 30.0 and "died 5 times in 60 s (last: killed by SIGKILL)" in w.benched


def test_a_death_just_after_ready_counts_as_one_before_it(sup):
    for _ in range(4):
        die(sup, ready_for=READY_GRACE_S / 2)
    assert die(sup, ready_for=READY_GRACE_S / 2) == 30.0 and sup.workers[0].benched


def test_a_worker_killed_while_serving_is_restarted_at_once_every_time(sup):
    w = sup.workers[0]
    for _ in range(20):   # four times the guard's threshold, one kill every 5 s
        assert die(sup, ready_for=5.0) == pytest.approx(FIRST_DELAY_S)
        assert w.benched == ""
    # and a life that served wipes the slate: deaths before ready count afresh from it
    assert [die(sup) for _ in range(2)] == pytest.approx([0.1, 0.2])
    assert die(sup, ready_for=60.0) == pytest.approx(FIRST_DELAY_S)
    assert die(sup) == pytest.approx(0.1)


def status_worker(c: Client) -> dict:
    (w,) = c.status()["workers"]
    return w


def test_sigkill_while_serving_never_trips_the_guard(model_files, make_broker):
    """Killed more times than crash_loop.deaths, each time once serving again: restarted every
    time, and no request is refused MODEL_NOT_READY (before the fix the second kill benched the
    worker for backoff_s)."""
    guard = {"crash_loop": {"deaths": 2, "window_s": 60.0, "backoff_s": 30.0}}
    b = make_broker(base_config(model_files, "mlp", supervisor=guard))
    load = Load(b.address, 2, lambda i, k: {"x": X})   # under load, as an OOM kill comes
    kills = 3
    counts = None
    try:
        with Client(b.address) as c:
            for n in range(kills):
                w = wait_until(lambda: (w := status_worker(c))["state"] == "ready" and w, 20, "the worker to serve")
                assert w["restarts"] == n and w["benched"] == ""
                seen_ready = time.monotonic()
                # serving: requests succeed, until it has served past READY_GRACE_S (the broker
                # saw it ready before this test did)
                wait_until(lambda: c.infer("mlp", {"x": X})["y"].shape == (1, 10)
                           and time.monotonic() - seen_ready >= READY_GRACE_S, 30, "requests to be served")
                os.kill(w["pid"], signal.SIGKILL)
                wait_until(lambda: status_worker(c)["pid"] != w["pid"], 20, "the worker to be replaced")
            w = wait_until(lambda: (w := status_worker(c))["state"] == "ready" and w, 20, "the worker to serve")
            assert w["restarts"] == kills and w["benched"] == ""
            assert c.infer("mlp", {"x": X})["y"].shape == (1, 10)
    finally:
        counts = load.finish()
    assert set(counts) <= {"ok", "WORKER_DIED"}, counts   # never MODEL_NOT_READY
    assert "crash loop" not in b.output()
