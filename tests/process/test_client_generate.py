"""Client.generate and AsyncClient.generate end to end: a real broker and worker running the test
generator `Counter` (tgw.testing.generators: output n of a prompt is (sum(prompt) + n) % 1000).
Its outputs in order with their `final` record; async streams side by side; a stream closed (sync
close, async aclose, a dropped stream) cancels its sequence, and status shows the slots its
worker freed; status, its printout and /metrics show the generator. The stream object against a
scripted peer: tests/unit/test_client_generation.py; a stream over its worker's death:
tests/process/test_generation.py."""
from __future__ import annotations

import asyncio
import gc
import subprocess
import sys

import numpy as np
import pytest
from conftest import wait_until
from prometheus_client.parser import text_string_to_metric_families

from tgw.client import AsyncClient, Client, InvalidArgumentError
from tgw.testing.generators import entry

MODEL, SLOW = "count", "slowcount"


def config() -> dict:
    # SLOW: 100 outputs/s, so a stream left unread for a moment is no slow reader (a full pipe,
    # 2,000 messages, takes 20 s): the cancels are the test's
    return {"workers": {"devices": ["cpu"], "threads_per_worker": 1, "input_arena_mb": 2, "output_arena_mb": 2},
            "models": [entry(MODEL, "Counter", max_sequences=4, max_outputs=1_000_000),
                       entry(SLOW, "Counter", {"step_ms": 10}, max_sequences=4, max_outputs=1_000_000)]}


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    import shutil
    import tempfile

    from tgw.testing.child import BrokerProc
    d = tempfile.mkdtemp(prefix="tgwcg-", dir="/tmp")
    b = BrokerProc(config(), d).start()
    try:
        yield b
    finally:
        code = b.stop()
        shutil.rmtree(d, ignore_errors=True)
        assert code == 0, b.output()


def expected(prompt, n: int) -> list[int]:
    return [(sum(prompt) + k) % 1000 for k in range(n)]


def generation(c: Client, model: str = MODEL) -> dict:
    return c.status()["models"][model]["generation"]


def test_sync_generate_streams_outputs_in_order_and_final(broker):
    with Client(broker.address) as c:
        stream = c.generate(MODEL, np.array([300, 400, 299]), max_outputs=12, timeout=60)
        assert list(stream) == expected([300, 400, 299], 12)   # 999, 0, 1, ... : wraps at 1000
        f = stream.final
        assert (f.reason, f.outputs, f.resumed, f.model, f.version) == ("max_outputs", 12, 0, MODEL, "1")
        assert isinstance(f.seed, int) and 0 < f.first_output_ms <= f.total_ms
        with pytest.raises(InvalidArgumentError, match="1..1000000"):
            list(c.generate(MODEL, [1], max_outputs=2_000_000))   # the broker's cap


def test_async_generates_side_by_side(broker):
    prompts = [[1], [2, 3], [4, 5, 6], [7] * 9]

    async def run():
        async with AsyncClient(broker.address) as c:
            async def one(prompt):
                s = c.generate(MODEL, {"prompt": prompt}, max_outputs=20, seed=5)
                return [t async for t in s], s.final
            return await asyncio.gather(*(one(p) for p in prompts))
    for prompt, (tokens, final) in zip(prompts, asyncio.run(run())):
        assert tokens == expected(prompt, 20) and final.outputs == 20 and final.seed == 5


def test_closing_a_stream_cancels_it_and_its_slot_is_freed(broker):
    with Client(broker.address) as c:
        with c.generate(SLOW, [10], timeout=120) as stream:     # a million outputs: runs until closed
            assert next(stream) == 10
        dropped = c.generate(SLOW, [20], timeout=120)
        assert next(dropped) == 20
        del dropped
        gc.collect()

        async def aclose():
            async with AsyncClient(broker.address) as ac:
                s = ac.generate(SLOW, [30], timeout=120)
                assert await s.__anext__() == 30
                await s.aclose()
        asyncio.run(aclose())
        g = wait_until(lambda: (lambda g: g if g["freed_by_cancel"] >= 3 and g["active"] == 0 else None)(
            generation(c, SLOW)), what="three cancelled sequences' slots freed")
        assert g["freed_by_cancel"] == 3 and g["ended"] == {"cancelled": 3} and g["slots"] == 4
        assert list(c.generate(SLOW, [1], max_outputs=3)) == [1, 2, 3]   # the slots serve again


def test_status_printout_and_metrics_show_the_generator(broker):
    with Client(broker.address) as c:
        assert list(c.generate(MODEL, [7], max_outputs=5)) == [7, 8, 9, 10, 11]
        g = generation(c)
    assert g["outputs"] >= 5 and g["slots"] == 4 and g["ended"]["max_outputs"] >= 1 and g["first_output_ms"] > 0
    printed = subprocess.run([sys.executable, "-m", "tgw.broker", "status", "--address", broker.address],
                             capture_output=True, text=True, timeout=60)
    assert printed.returncode == 0, printed.stderr
    assert f"generator {MODEL}: " in printed.stdout and "slots busy" in printed.stdout
    scraped = subprocess.run([sys.executable, "-m", "tgw.broker", "metrics", "--address", broker.address],
                             capture_output=True, text=True, timeout=60)
    assert scraped.returncode == 0, scraped.stderr
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(scraped.stdout) for s in f.samples}
    assert samples["tgw_generator_slots", (("model", MODEL),)] == 4
    assert samples["tgw_generator_outputs_total", (("model", MODEL),)] >= 5
    assert samples["tgw_generator_sequences_total", (("model", MODEL), ("reason", "max_outputs"))] >= 1
    assert samples["tgw_generator_first_output_seconds_count", (("model", MODEL),)] >= 1

