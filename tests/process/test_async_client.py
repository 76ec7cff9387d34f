"""AsyncClient on a real broker: many requests on one connection, cancel, timeouts, retries,
goodbye, and the queued requests of a client that vanished.

Queueing is made deterministic with the `spin` model (x[0,0] rounds of a matmul) on one worker
that takes one batch at a time: a long `blocker` holds the worker, so what is sent after it
stays queued until the test acts on it.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import uvloop

from conftest import base_config, wait_until
from tgw.client import Client, ConnectError, DeadlineExceededError, ModelNotFoundError, RateLimitedError
from tgw.client.aio import AsyncClient
from tgw.client.retry import REREGISTER, Attempts, RetryPolicy
from tgw.shm.errors import Code, fail

X = np.arange(256, dtype=np.float32).reshape(1, 256) / 256
BLOCKER_ROUNDS = 5000      # ~2 s of compute here: far longer than any step the tests take meanwhile


def spin(rounds: int) -> dict:
    x = np.full((1, 1), rounds, np.float32)
    return {"x": x}


def one_at_a_time(files, **extra) -> dict:
    cfg = base_config(files, "mlp", "spin", spin={"max_batch_size": 1, "max_queue": 256},
                      workers={"devices": ["cpu"], "threads_per_worker": 1, "input_arena_mb": 8, "output_arena_mb": 4},
                      server={"max_inflight_batches_per_worker": 1})
    cfg.update(extra)
    return cfg


def run(coro):
    return uvloop.run(coro)


def queued(c: Client, model: str = "spin") -> int:
    return c.stats()["models"][model]["queued"]


async def start_blocker(ac: AsyncClient, c: Client) -> asyncio.Future:
    """The long spin request, once it is on the worker (so what follows it stays queued)."""
    blocker = asyncio.ensure_future(ac.infer("spin", spin(BLOCKER_ROUNDS)))
    await asyncio.to_thread(wait_until, lambda: queued(c) == 0 and c.stats()["models"]["spin"]["requests"] == 1,
                            what="the blocker on the worker")
    return blocker


def test_thousands_in_flight_on_one_connection_match_the_sync_client(model_files, make_broker):
    # one connection may have server.max_inflight_per_client requests admitted (default 1024); the
    # replies waiting for it to read may be as many (client_queue_messages, default 1000: past it a
    # reply is dropped, and these calls have no timeout to learn it by)
    b = make_broker(base_config(model_files, "mlp", server={"max_inflight_per_client": 4096,
                                                            "client_queue_messages": 4096},
                                mlp={"max_queue": 4096}))
    xs = np.random.default_rng(0).random((3000, 1, 256), dtype=np.float32)
    with Client(b.address) as c:
        expected = [c.infer("mlp", {"x": x})["y"] for x in xs[:20]]

    async def main():
        async with AsyncClient(b.address) as ac:
            tasks = [asyncio.ensure_future(ac.infer("mlp", {"x": x})) for x in xs]
            await asyncio.sleep(0)
            peak = ac.inflight
            results = await asyncio.gather(*tasks)
            meta = await ac.infer_with_meta("mlp", {"x": xs[0]}, return_type="torch")
            return peak, results, meta
    peak, results, meta = run(main())
    assert peak == len(xs)   # every request sent before any answer was awaited
    for got, want in zip(results, expected):   # batched with others: equal up to float summation order
        np.testing.assert_allclose(got["y"], want, rtol=1e-5, atol=1e-6)
    assert meta.version == "1" and type(meta.outputs["y"]).__module__.startswith("torch")
    np.testing.assert_allclose(meta.outputs["y"].numpy(), expected[0], rtol=1e-5, atol=1e-6)


def test_async_errors_are_the_sync_errors(shared_broker):
    async def main():
        async with AsyncClient(shared_broker.address) as ac:
            with pytest.raises(ModelNotFoundError):
                await ac.infer("nope", {"x": X})
            with pytest.raises(Exception) as bad:
                await ac.infer("mlp", {"x": X}, timeout=-1)
            assert bad.value.code is Code.INVALID_ARGUMENT
            assert (await ac.health())["live"] and (await ac.models())
        nowhere = AsyncClient(shared_broker.address + ".missing", connect_timeout=0.5)
        with pytest.raises(ConnectError):
            await nowhere.infer("mlp", {"x": X})
        await nowhere.close()
    run(main())


def test_cancelling_the_awaiting_task_drops_the_queued_request(model_files, make_broker):
    b = make_broker(one_at_a_time(model_files))
    with Client(b.address) as c:
        async def main():
            async with AsyncClient(b.address) as ac:
                blocker = await start_blocker(ac, c)
                waiting = [asyncio.ensure_future(ac.infer("spin", spin(1))) for _ in range(10)]
                await asyncio.to_thread(wait_until, lambda: queued(c) == 10, what="ten queued")
                for t in waiting:
                    t.cancel()
                await asyncio.gather(*waiting, return_exceptions=True)
                await asyncio.to_thread(wait_until, lambda: c.stats()["abandoned"].get("cancelled") == 10,
                                        what="ten cancelled")
                assert queued(c) == 0
                assert (await blocker)["y"].shape == (1, 1)   # the one running is not disturbed
        run(main())
        assert c.stats()["models"]["spin"]["errors"] == {}   # a cancel is not an error


def test_a_timeout_cancels_the_request_at_the_broker(model_files, make_broker):
    b = make_broker(one_at_a_time(model_files))
    with Client(b.address) as c:
        async def main():
            async with AsyncClient(b.address) as ac:
                blocker = await start_blocker(ac, c)
                # the broker's own deadline would answer it too, but later: the client gives up
                # first (the local wait is the timeout plus 0.1 s) and cancels
                with pytest.raises(DeadlineExceededError) as late:
                    await ac.infer("spin", spin(1), timeout=0.05)
                assert late.value.details.get("source") in ("client", None)
                await blocker
        run(main())
        counted = c.stats()
        assert counted["abandoned"].get("cancelled", 0) + sum(counted["models"]["spin"]["errors"].values()) >= 1


def test_retry_policy_retries_retryable_errors_only(model_files, make_broker):
    cfg = base_config(model_files, "mlp")
    cfg["tenants"] = {"slow": {"rate": 1, "burst": 1}}
    b = make_broker(cfg)
    policy = RetryPolicy(attempts=8, backoff=0.1, max_backoff=1.0)   # and the broker's retry_after_ms
    with Client(b.address, retry=policy) as c:
        async def main():
            async with AsyncClient(b.address, retry=policy) as ac:
                for _ in range(3):   # the burst is 1: the 2nd and 3rd are limited, retried, and pass
                    assert (await ac.infer("mlp", {"x": X}, tenant="slow"))["y"].shape == (1, 10)
                with pytest.raises(RateLimitedError):
                    await ac.infer("mlp", {"x": X}, tenant="slow", retry=RetryPolicy(attempts=1))
                with pytest.raises(ModelNotFoundError):
                    await ac.infer("nope", {"x": X})
        run(main())
        assert c.infer("mlp", {"x": X}, tenant="slow")["y"].shape == (1, 10)
        tenant = c.stats()["tenants"]["slow"]
        assert tenant["limited"]["rate"] >= 2 and tenant["admitted"] == 4
        assert c.stats()["errors"].get("MODEL_NOT_FOUND") == 1   # not retried


def test_retry_delays_follow_the_policy_and_the_deadline():
    policy = RetryPolicy(attempts=4, backoff=0.1, multiplier=2, max_backoff=0.3, jitter=0)
    busy = fail(Code.OVERLOADED, "busy")
    assert [policy.delay(busy, n, None) for n in (1, 2, 3, 4)] == [0.1, 0.2, 0.3, None]
    assert policy.delay(busy, 1, left=0.05) is None               # the wait would pass the deadline
    assert policy.delay(fail(Code.INVALID_ARGUMENT, "no"), 1, None) is None
    assert policy.delay(fail(Code.WORKER_DIED, "x", poison=True), 1, None) is None
    assert policy.delay(fail(Code.CIRCUIT_OPEN, "x", retry_after_ms=700), 1, None) == 0.7
    assert policy.delay(ValueError("not tgw's"), 1, None) is None
    jittered = RetryPolicy(backoff=1.0, jitter=0.5)
    assert all(0.5 <= jittered.delay(busy, 1, None) <= 1.0 for _ in range(100))
    tries = Attempts(None, None)
    assert tries.left() is None and tries.after(busy) is None
    lost = fail(Code.INVALID_ARGUMENT, "region 3 is not registered", reason="unknown_region")
    once = Attempts(None, None, region=object())   # a restarted broker: register again, once
    assert once.after(lost) is REREGISTER and once.after(lost) is None
    with pytest.raises(ValueError):
        RetryPolicy(attempts=0)


def test_closing_the_client_drops_its_queued_requests(model_files, make_broker):
    b = make_broker(one_at_a_time(model_files))
    with Client(b.address) as c:
        async def main():
            ac = AsyncClient(b.address)
            await ac.connect()
            blocker = await start_blocker(ac, c)
            waiting = [asyncio.ensure_future(ac.infer("spin", spin(1))) for _ in range(6)]
            await asyncio.to_thread(wait_until, lambda: queued(c) == 6, what="six queued")
            await ac.close()
            ended = await asyncio.gather(blocker, *waiting, return_exceptions=True)
            assert all(getattr(e, "code", None) is Code.UNAVAILABLE for e in ended)
        run(main())
        wait_until(lambda: c.stats()["abandoned"].get("client_closed") == 6, what="six dropped at goodbye")
        assert queued(c) == 0


VANISHING = textwrap.dedent("""
    import asyncio, sys, numpy as np
    from tgw.client.aio import AsyncClient
    async def main():
        ac = AsyncClient(sys.argv[1])
        await ac.connect()
        x = np.ones((1, 1), np.float32)
        tasks = [asyncio.ensure_future(ac.infer("spin", {"x": x})) for _ in range(5)]
        await asyncio.sleep(3600)    # killed by the test long before
    asyncio.run(main())
""")


def test_the_queued_requests_of_a_vanished_client_are_dropped(model_files, make_broker, short_dir):
    b = make_broker(one_at_a_time(model_files))
    with Client(b.address) as c:
        blocker_done = []

        async def hold():
            async with AsyncClient(b.address) as ac:
                task = await start_blocker(ac, c)
                script = os.path.join(short_dir, "vanish.py")
                with open(script, "w") as f:
                    f.write(VANISHING)
                child = subprocess.Popen([sys.executable, script, b.address])
                try:
                    await asyncio.to_thread(wait_until, lambda: queued(c) == 5, what="its five queued")
                finally:
                    os.kill(child.pid, signal.SIGKILL)
                    child.wait()
                await asyncio.to_thread(wait_until, lambda: c.stats()["abandoned"].get("client_gone") == 5,
                                        what="five dropped for the dead client")
                assert queued(c) == 0
                blocker_done.append(await task)
        run(hold())
        assert blocker_done and c.stats()["dropped"].get("client_gone", 0) == 0   # nothing computed for it


def test_a_burst_past_the_callers_cap_waits_in_the_client_and_is_all_served(model_files, make_broker):
    """2,000 at once on one connection whose broker allows 64 in flight: the client learns the cap
    from the hello and holds the rest back, so none is refused OVERLOADED."""
    b = make_broker(base_config(model_files, "mlp", server={"max_inflight_per_client": 64}))
    xs = np.random.default_rng(1).random((2000, 1, 256), dtype=np.float32)

    async def main():
        async with AsyncClient(b.address) as ac:
            assert ac.max_inflight_per_client == 64
            tasks = [asyncio.ensure_future(ac.infer("mlp", {"x": x})) for x in xs]
            await asyncio.sleep(0)
            sent, held = ac.inflight, ac.queued
            return sent, held, await asyncio.gather(*tasks, return_exceptions=True)
    sent, held, results = run(main())
    assert (sent, held) == (64, 2000 - 64)
    assert [r for r in results if not isinstance(r, dict)] == []
    with Client(b.address) as c:
        assert c.stats()["models"]["mlp"]["errors"] == {}
        np.testing.assert_allclose(results[7]["y"], c.infer("mlp", {"x": xs[7]})["y"], rtol=1e-5, atol=1e-6)


def test_requests_held_in_the_client_that_are_cancelled_or_time_out_never_reach_the_broker(model_files, make_broker):
    b = make_broker(one_at_a_time(model_files, server={"max_inflight_per_client": 4,
                                                       "max_inflight_batches_per_worker": 1}))
    with Client(b.address) as c:
        async def main():
            async with AsyncClient(b.address) as ac:
                blocker = await start_blocker(ac, c)
                at_broker = [asyncio.ensure_future(ac.infer("spin", spin(1))) for _ in range(3)]
                await asyncio.to_thread(wait_until, lambda: queued(c) == 3, what="three queued at the broker")
                held = [asyncio.ensure_future(ac.infer("spin", spin(1))) for _ in range(5)]
                await asyncio.sleep(0)
                assert (ac.inflight, ac.queued) == (4, 5)
                with pytest.raises(DeadlineExceededError) as late:
                    await ac.infer("spin", spin(1), timeout=0.05)
                assert late.value.details["reason"] == "client_queue" and "never sent" in str(late.value)
                for t in held[:2]:
                    t.cancel()
                done = await asyncio.gather(blocker, *at_broker, *held, return_exceptions=True)
                assert [type(r).__name__ for r in done] == ["dict"] * 4 + ["CancelledError"] * 2 + ["dict"] * 3
        run(main())
        counted = c.stats()
        assert counted["models"]["spin"]["requests"] == 1 + 3 + 3   # the three given up on never came
        assert counted["models"]["spin"]["errors"] == {} and not counted["abandoned"].get("cancelled")
        with c.stream("mlp", window=100) as s:   # the sync stream keeps to the cap too
            for _ in range(12):
                s.send({"x": X})
                assert s.outstanding <= 4
        assert [r.error for r in s] == [None] * 12
