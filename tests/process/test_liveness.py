"""A client learns of a dead or restarted broker: the calls waiting on it raise UnavailableError
(not a timeout, not a hang), and the same client serves again once a broker is back."""
from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import uvloop

from conftest import base_config, kill_broker, wait_until
from tgw.client import Client, ConnectError, UnavailableError
from tgw.client.aio import AsyncClient
from tgw.client.connection import Link
from tgw.shm.errors import Code

from test_async_client import BLOCKER_ROUNDS, one_at_a_time, queued, spin

X = np.zeros((1, 256), np.float32)


def test_sync_call_without_timeout_raises_when_the_broker_dies(model_files, make_broker):
    b = make_broker(one_at_a_time(model_files))
    ended = {}
    with Client(b.address) as watcher, Client(b.address) as c:
        def call():
            try:
                c.infer("spin", spin(BLOCKER_ROUNDS))   # no timeout: it would wait for the model's 30 s
            except Exception as exc:  # noqa: BLE001 - the test looks at what it was
                ended["error"] = exc
        t = threading.Thread(target=call)
        t.start()
        wait_until(lambda: watcher.stats()["models"]["spin"]["requests"] == 1, what="the call admitted")
        kill_broker(b)
        t.join(30)
        assert not t.is_alive()
        err = ended["error"]
        assert isinstance(err, UnavailableError) and err.retryable and "was lost" in err.message
        # the broker comes back at the same address: the same client serves again
        b.start()
        assert c.infer("mlp", {"x": X})["y"].shape == (1, 10)


def test_async_calls_in_flight_all_end_when_the_broker_dies_and_the_client_recovers(model_files, make_broker):
    b = make_broker(one_at_a_time(model_files))

    async def main():
        async with AsyncClient(b.address, liveness=2.0) as ac:
            blocker = asyncio.ensure_future(ac.infer("spin", spin(BLOCKER_ROUNDS)))
            waiting = [asyncio.ensure_future(ac.infer("spin", spin(1))) for _ in range(200)]
            with Client(b.address) as watcher:
                await asyncio.to_thread(wait_until, lambda: queued(watcher) == 200, what="200 queued")
            await asyncio.to_thread(kill_broker, b)
            ended = await asyncio.gather(blocker, *waiting, return_exceptions=True)
            assert all(isinstance(e, UnavailableError) for e in ended), {type(e) for e in ended}
            assert ac.inflight == 0
            await asyncio.to_thread(b.start)
            return await ac.infer("mlp", {"x": X})
    assert uvloop.run(main())["y"].shape == (1, 10)


def test_a_call_while_no_broker_is_up_fails_within_liveness(model_files, make_broker):
    b = make_broker(base_config(model_files, "mlp"))

    async def main():
        async with AsyncClient(b.address, liveness=0.5) as ac:
            await asyncio.to_thread(kill_broker, b)
            with pytest.raises(UnavailableError) as down:
                for _ in range(3):   # the first may still meet the dying connection
                    await ac.infer("mlp", {"x": X})
            return down.value
    err = uvloop.run(main())
    assert err.code is Code.UNAVAILABLE and err.details["source"] == "client"
    with pytest.raises(ConnectError):
        Client(b.address, connect_timeout=0.5)
    b.start()   # a new broker at the address sweeps what the killed one left in /dev/shm


def test_heartbeats_are_set_on_client_sockets(shared_broker):
    import zmq
    ctx = zmq.Context()
    try:
        link = Link(ctx, shared_broker.address, liveness=3.0)
        assert link.sock.getsockopt(zmq.HEARTBEAT_TIMEOUT) == 2250   # + one interval: within liveness
        assert link.sock.getsockopt(zmq.HEARTBEAT_IVL) == 750
        assert link.sock.getsockopt(zmq.IMMEDIATE) == 1
        assert link.wait_up(10) and link.up
        link.close()
        plain = Link(ctx, shared_broker.address, liveness=None)
        assert plain.sock.getsockopt(zmq.HEARTBEAT_IVL) == 0
        plain.close()
    finally:
        ctx.term()
