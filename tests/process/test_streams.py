"""Streaming sessions, sync and async: tagged results, the window, errors per request, close."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import uvloop

from tgw.client import Client, InvalidArgumentError, ModelNotFoundError
from tgw.client.aio import AsyncClient

XS = np.random.default_rng(1).random((300, 1, 256), dtype=np.float32)


@pytest.fixture(scope="module")
def expected(shared_broker):
    with Client(shared_broker.address) as c:
        return [c.infer("mlp", {"x": x})["y"] for x in XS]


def check(results: list, expected: list) -> None:
    assert sorted(r.tag for r in results) == list(range(len(expected)))
    for r in results:   # batched with others: equal up to float summation order
        np.testing.assert_allclose(r.result()["y"], expected[r.tag], rtol=1e-5, atol=1e-6)


def test_sync_stream_tags_window_and_graceful_close(shared_broker, expected):
    with Client(shared_broker.address) as c:
        results, peak = [], 0
        with c.stream("mlp", window=16, timeout=10) as s:
            for i, x in enumerate(XS):
                assert s.send({"x": x}, tag=i) == i
                peak = max(peak, s.outstanding)
                assert s.outstanding <= 16
                results.extend(s.ready())
            s.close()                     # waits for what is outstanding
            results.extend(s.ready())     # which can still be taken
        assert peak == 16 and s.outstanding == 0
        check(results, expected)
        # the client's own calls are untouched by the session's socket
        np.testing.assert_array_equal(c.infer("mlp", {"x": XS[0]})["y"], expected[0])


def test_sync_stream_iterates_to_the_end_and_reports_errors_per_request(shared_broker, expected):
    with Client(shared_broker.address) as c:
        s = c.stream("mlp", window=8)
        for i, x in enumerate(XS[:20]):
            s.send({"x": x}, tag=i)
        s.send({"x": XS[0]}, tag="wrong", outputs=["nope"])
        results = list(s)
        assert s.next() is None
        s.close()
    bad = [r for r in results if r.tag == "wrong"]
    assert len(bad) == 1 and bad[0].outputs is None and isinstance(bad[0].error, InvalidArgumentError)
    with pytest.raises(InvalidArgumentError):
        bad[0].result()
    check([r for r in results if r.tag != "wrong"], expected[:20])


def test_stream_window_must_be_positive(shared_broker):
    with Client(shared_broker.address) as c:
        with pytest.raises(InvalidArgumentError):
            c.stream("mlp", window=0)


def test_async_stream_producer_and_consumer(shared_broker, expected):
    async def main():
        async with AsyncClient(shared_broker.address) as ac:
            s = ac.stream("mlp", window=32, timeout=10)
            peak = 0

            async def produce():
                nonlocal peak
                for i, x in enumerate(XS):
                    await s.send({"x": x}, tag=i)
                    peak = max(peak, s.outstanding)
                    assert s.outstanding <= 32
                await s.close()

            async def consume():
                return [r async for r in s]
            _, results = await asyncio.gather(produce(), consume())
            async with ac.stream("nope") as failing:
                await failing.send({"x": XS[0]})
            errors = [r async for r in failing]   # taken after the close
            return results, peak, errors
    results, peak, errors = uvloop.run(main())
    assert peak == 32
    check(results, expected)
    assert len(errors) == 1 and isinstance(errors[0].error, ModelNotFoundError)
