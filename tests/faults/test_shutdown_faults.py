"""SIGTERM with work queued or computing: every admitted request is answered, within the grace
or with MODEL_NOT_READY (reason shutting_down) when it runs out. Each scenario prints its row of
the fault table (tests/faults/tally.py)."""
from __future__ import annotations

import signal
import threading

import numpy as np

from conftest import base_config, wait_until
from tally import Tally, row
from tgw.client import Client
from tgw.shm.errors import Code, TgwError
from tgw.shm.segment import list_segments

TWO_WORKERS = {"devices": ["cpu", "cpu"], "threads_per_worker": 1, "input_arena_mb": 4, "output_arena_mb": 2}


def test_sigterm_under_load_answers_every_admitted_request(model_files, make_broker):
    b = make_broker(base_config(model_files, "mlp", workers=TWO_WORKERS))
    callers = 32
    sent = threading.Semaphore(0)
    t = Tally(f"SIGTERM with {callers} requests admitted")
    results: list = []

    def one(c: Client) -> None:
        sent.release()
        results.append(t.call(c.infer, "mlp", {"x": np.ones((4, 256), np.float32)}))

    with Client(b.address) as c:
        baseline = c.stats()["models"]["mlp"]["requests"]
        threads = [threading.Thread(target=one, args=(c,)) for _ in range(callers)]
        for th in threads:
            th.start()
        for _ in range(callers):
            sent.acquire(timeout=60)
        # every request is admitted (queued or computing) before the signal
        wait_until(lambda: c.stats()["models"]["mlp"]["requests"] - baseline == callers, 60, "all to be admitted")
        b.proc.send_signal(signal.SIGTERM)
        for th in threads:
            th.join(60)
    assert b.proc.wait(60) == 0
    row(t, f"broker exit {b.proc.returncode}")
    assert t.counts == {"ok": callers}, results
    assert list_segments(b.proc.pid) == []


def test_grace_running_out_answers_what_is_left(model_files, make_broker):
    b = make_broker(base_config(model_files, "spin", supervisor={"shutdown_grace_s": 0.5},
                                spin={"max_batch_size": 1}))
    t = Tally("SIGTERM, 4 x 0.7 s queued, grace 0.5 s")
    results: list = []

    def one(c: Client) -> None:
        results.append(t.call(c.infer, "spin", {"x": np.full((1, 1), 1500, np.float32)}))

    with Client(b.address) as c:
        threads = [threading.Thread(target=one, args=(c,)) for _ in range(4)]
        for th in threads:
            th.start()
        wait_until(lambda: c.stats()["models"]["spin"]["requests"] == 4, 60, "all to be admitted")
        b.proc.send_signal(signal.SIGTERM)
        for th in threads:
            th.join(60)
    assert b.proc.wait(60) == 0
    row(t, f"broker exit {b.proc.returncode}")
    errors = [r for r in results if isinstance(r, TgwError)]
    assert t.sent == 4 and t.unanswered == 0 and errors  # ~0.7 s each: not all four fit in the 0.5 s grace
    assert set(t.errors) == {"MODEL_NOT_READY"}
    assert all(e.code == Code.MODEL_NOT_READY and e.details["reason"] == "shutting_down" for e in errors)
    assert "shutdown_grace_s (0.5 s) ran out" in b.output()
