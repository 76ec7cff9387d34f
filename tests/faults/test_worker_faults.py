"""Workers failing under load, with real processes: SIGKILLed, SIGSTOPped, a poison request that
aborts its worker. Every request gets an answer; each scenario prints its row of the fault table
(tests/faults/tally.py; run with -s to see the rows as they come), never asserting timings.

Bounded: the kill loop runs 2 rounds by default, 6 with TGW_SLOW=1 (one kill per round, each
round waiting until the replacement serves)."""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import EXT, Load, base_config, wait_until
from tally import Tally, row
from tgw.client import Client
from tgw.shm.errors import Code
from tgw.shm.segment import list_segments

KILL_ROUNDS = 6 if os.environ.get("TGW_SLOW") else 2
TWO_WORKERS = {"devices": ["cpu", "cpu"], "threads_per_worker": 1, "input_arena_mb": 4, "output_arena_mb": 2}
X = np.ones((1, 256), np.float32)


@pytest.fixture(autouse=True)
def no_core_files():
    """Aborting workers must not leave core files (the limit is inherited by broker and workers)."""
    old = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (0, old[1]))
    yield
    resource.setrlimit(resource.RLIMIT_CORE, old)


def worker_pids(c: Client) -> list[int]:
    return [w["pid"] for w in c.status()["workers"]]


def all_ready(c: Client) -> bool:
    return all(w["state"] == "ready" for w in c.status()["workers"])


def test_workers_killed_under_load_lose_nothing(model_files, make_broker):
    b = make_broker(base_config(model_files, "mlp", workers=TWO_WORKERS))
    t = Tally(f"worker SIGKILL x{KILL_ROUNDS}, 32 callers")
    load = Load(b.address, 32, lambda i, k: {"x": X}, tally=t)
    replaced_s = []
    with Client(b.address) as c:
        for round_ in range(KILL_ROUNDS):
            wait_until(lambda: len(load.results) > 200 * (round_ + 1), 60, "traffic to flow")
            victim = worker_pids(c)[round_ % 2]
            t0 = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            wait_until(lambda: victim not in worker_pids(c) and all_ready(c), 60, "the replacement to serve")
            replaced_s.append(time.monotonic() - t0)
        restarts = sum(w["restarts"] for w in c.status()["workers"])
    load.finish()
    row(t, f"restarts {restarts}; replacement serving after {', '.join(f'{s:.2f}' for s in replaced_s)} s")
    assert restarts == KILL_ROUNDS
    assert set(t.counts) <= {"ok", "WORKER_DIED"} and t.ok >= 0.995 * t.sent
    assert len([s for s in list_segments(b.proc.pid)]) == 2  # live rings only: the dead ones went


def test_stopped_worker_is_killed_and_replaced(model_files, make_broker):
    b = make_broker(base_config(model_files, "mlp", workers=TWO_WORKERS,
                                supervisor={"heartbeat_s": 0.25, "hang_timeout_s": 2.0}))
    t = Tally("worker SIGSTOP (hang_timeout_s 2), 8 callers")
    load = Load(b.address, 8, lambda i, k: {"x": X}, timeout=20.0, tally=t)
    with Client(b.address) as c:
        wait_until(lambda: len(load.results) > 100, 60, "traffic to flow")
        victim = worker_pids(c)[0]
        t0 = time.monotonic()
        os.kill(victim, signal.SIGSTOP)
        w = wait_until(lambda: next((w for w in c.status()["workers"] if w["last_death"]), None), 60,
                       "the hung worker to be killed")
        killed_s = time.monotonic() - t0
        wait_until(lambda: victim not in worker_pids(c) and all_ready(c), 60, "the replacement to serve")
    load.finish()
    row(t, f"killed after {killed_s:.2f} s")
    assert "no heartbeat" in w["last_death"]
    assert set(t.counts) <= {"ok", "WORKER_DIED"} and t.ok >= 0.99 * t.sent


def test_poison_request_is_given_up_and_its_batch_mates_succeed(model_files, ext_models, make_broker):
    files = {**model_files, **ext_models}
    b = make_broker(base_config(files, "crash_on", workers={**TWO_WORKERS, "preload": [EXT]},
                                crash_on={"max_batch_size": 8}))
    mates, poison = Tally("poison request: its batch mates, 8 callers"), Tally("poison request: the poison")
    # inputs from 100 on: never the poison value 13
    load = Load(b.address, 8, lambda i, k: {"x": np.full((1, 1), 100 + i * 10**5 + k, np.float32)},
                model="crash_on", tally=mates)
    with Client(b.address) as c:
        wait_until(lambda: len(load.results) > 50, 60, "traffic to flow")
        err = poison.call(c.infer, "crash_on", {"x": np.full((1, 1), 13.0, np.float32)})
        restarts = sum(w["restarts"] for w in c.status()["workers"])
        wait_until(lambda: all_ready(c), 60, "the workers to be back")
    load.finish()
    row(mates)
    row(poison, f"{restarts} worker death(s); {getattr(err, 'message', err)!r}")
    assert poison.counts == {"WORKER_DIED": 1} and err.details["poison"] is True
    assert 1 <= restarts <= 2
    assert mates.counts == {"ok": mates.sent}  # never the poison's batch mates
    assert "two worker deaths" in b.output() and "model=crash_on" in b.output()


def test_status_cli_reports_workers_and_models(model_files, make_broker):
    b = make_broker(base_config(model_files, "mlp"))
    t = Tally("status CLI after one request")
    with Client(b.address) as c:
        t.call(c.infer, "mlp", {"x": X})
        wait_until(lambda: c.status()["workers"][0].get("batches"), 30, "a heartbeat counting the batch")
    row(t)
    assert t.counts == {"ok": 1}
    cmd = [sys.executable, "-m", "tgw.broker", "status", "--address", b.address]
    text = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert text.returncode == 0, text.stderr
    assert "serving" in text.stdout and "worker0[cpu]" in text.stdout and "mlp" in text.stdout
    reply = json.loads(subprocess.run(cmd + ["--json"], capture_output=True, text=True, timeout=60).stdout)
    worker, = reply["workers"]
    assert worker["state"] == "ready" and worker["rss"] > 0 and worker["models"] == ["mlp:1"]
    assert reply["models"]["mlp"]["ready"] and reply["models"]["mlp"]["replies"] >= 1
    gone = subprocess.run([sys.executable, "-m", "tgw.broker", "status", "--address",
                           f"ipc://{b.dir}/nobody.sock"], capture_output=True, text=True, timeout=60)
    assert gone.returncode == 1 and "no tgw broker" in gone.stderr
