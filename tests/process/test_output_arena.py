"""End to end: batches sized by their outputs too, through real processes with a 1 MiB output arena.

"wide" (a fixed 256 KiB output per row): batches stop growing at what the output arena holds,
so concurrent callers whose requests each fit are all answered; a request that can never fit
is refused at admission (OUT_OF_SHM, never computed). "grow" (a -1 output dim the caller sets):
the worker answers a batch too large for the arena in parts; a request too large alone is
answered OUT_OF_SHM by the worker.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

from conftest import Load, base_config, wait_until
from tgw.client import Client, TgwError

ARENA = 1 << 20              # workers.output_arena_mb: 1
ROW = 65536                  # float32 values per output row of "wide" (and of "grow", as sent here)
CALLERS, REQUESTS = 6, 60    # each request 2 or 3 rows (512 or 768 KiB of outputs): fits alone, rarely with another


@pytest.fixture
def broker(make_broker, model_files):
    workers = {"devices": ["cpu"], "threads_per_worker": 1, "input_arena_mb": 1, "output_arena_mb": 1}
    return make_broker(base_config(model_files, "wide", "grow", workers=workers))


class Sent:
    """The first-column value of every request sent, thread-safely: replies must bring each back."""

    def __init__(self, width: int | None):
        self.width, self.bases, self.lock = width, [], threading.Lock()

    def __call__(self, i: int, k: int) -> dict:
        rows, base = 2 + (i + k) % 2, float(i * 100_000 + k * 10)
        with self.lock:
            self.bases.append(base)
        x = base + np.arange(rows, dtype=np.float32)[:, None]
        if self.width is not None:   # "grow": column 1 sets the output width
            x = np.hstack([x, np.full((rows, 1), self.width, np.float32)])
        return {"x": x}


def run_load(address: str, model: str, sent: Sent) -> list:
    load = Load(address, CALLERS, sent, model=model)
    wait_until(lambda: len(load.results) >= REQUESTS, 120, f"{REQUESTS} answers")
    counts = load.finish()
    assert counts == {"ok": len(load.results)}, counts      # before: mostly OUT_OF_SHM
    bases = []
    for out in load.results:
        y = out["y"]
        assert y.shape[1] == ROW and (y == y[:, :1]).all()  # each row its own value, whole
        np.testing.assert_array_equal(y[:, 0], y[0, 0] + np.arange(len(y)))  # a request's rows, in order
        bases.append(float(y[0, 0]))
    assert sorted(bases) == sorted(sent.bases)              # every request got its own rows back
    return load.results


def assert_out_of_shm(err: TgwError, needed: int) -> None:
    assert err.code.value == "OUT_OF_SHM", err
    assert f"{needed} bytes" in err.message and str(ARENA) in err.message
    assert "workers.output_arena_mb" in err.message
    assert not err.retryable   # the same request would fail again: a client must not retry it
    assert {k: err.details[k] for k in ("needed", "limit", "arena", "config_key")} == {
        "needed": needed, "limit": ARENA, "arena": "output", "config_key": "workers.output_arena_mb"}


def test_fixed_size_outputs_batch_within_the_arena(broker):
    run_load(broker.address, "wide", Sent(None))
    with Client(broker.address) as c:
        sizes = c.stats()["models"]["wide"]["batch_sizes"]
        assert max(int(rows) for rows in sizes) <= ARENA // (4 * ROW)   # 4 rows of 256 KiB fill it
        before = c.stats()["models"]["wide"]
        with pytest.raises(TgwError) as info:
            c.infer("wide", {"x": np.zeros((5, 1), np.float32)})       # 1.25 MiB of outputs
        assert_out_of_shm(info.value, 5 * 4 * ROW)
        after = c.stats()["models"]["wide"]
        # refused at admission: never queued, never computed
        assert (after["requests"], after["rows"]) == (before["requests"], before["rows"])
        assert c.infer("wide", {"x": np.ones((4, 1), np.float32)})["y"].shape == (4, ROW)


def test_variable_size_outputs_come_back_in_parts(broker):
    run_load(broker.address, "grow", Sent(ROW))
    with Client(broker.address) as c:
        width = 300_000                                            # 1.2 MB: one row can never fit
        with pytest.raises(TgwError) as info:
            c.infer("grow", {"x": np.array([[1.0, width]], np.float32)})
        assert_out_of_shm(info.value, 4 * width)
        y = c.infer("grow", {"x": np.array([[7.0, ROW], [8.0, ROW]], np.float32)})["y"]
        assert y.shape == (2, ROW) and (y[0] == 7).all() and (y[1] == 8).all()
