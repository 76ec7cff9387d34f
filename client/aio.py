"""AsyncClient: the tgw client for asyncio (and uvloop): thousands of requests in flight on one
connection, each awaited by its own caller.

    async with AsyncClient() as c:
        y = (await c.infer("mlp", {"x": x}, timeout=1.0))["y"]

One DEALER socket read by the event loop (its FD is edge-triggered: drained until empty, and
drained once more after each send, which may consume the edge), replies matched to waiting
futures by request id. Cancelling the task that awaits `infer` (or its timeout passing)
sends the broker a `cancel`, coalesced per loop turn, so a request still queued never runs.
A lost connection fails every waiting call with UnavailableError (client/connection.py).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
from typing import Any

import zmq

from tgw.shm.errors import Code, TgwError, error_from_body, fail
from tgw.shm.paths import ipc_path
from tgw.shm.wire import PROTOCOL_VERSION, Cancel, ErrorReply, Goodbye, Health, Hello, ListModels, Metadata, \
    Stats, Status, as_builtins, encode

from .client import (CONNECT_TIMEOUT_S, GOODBYE_LINGER_MS, NO_TIMEOUT_WAIT_S, REPLY_GRACE_S, ConnectError, InferResult,
                     health_dict, model_dict, read_reply, settings, stats_dict, status_dict)
from .connection import LIVENESS_S, Link
from .request import Call, prepare
from .retry import REREGISTER, Attempts, RetryPolicy
from .tensors import ZERO_COPY_MIN

log = logging.getLogger("tgw.client")
NOBLOCK, SNDMORE, POLLIN, EVENTS = int(zmq.NOBLOCK), int(zmq.SNDMORE), int(zmq.POLLIN), int(zmq.EVENTS)


class AsyncClient:
    def __init__(self, address: str | None = None, *, token: str | None = None,
                 server_key: str | bytes | None = None, connect_timeout: float = CONNECT_TIMEOUT_S,
                 liveness: float | None = LIVENESS_S, retry: RetryPolicy | None = None):
        """The arguments are Client's. Connects on `async with` or `await connect()` (or the
        first call)."""
        self.connect_timeout, self.liveness, self.retry = connect_timeout, liveness, retry
        self.address, self.token, self.tenant, self._server_key, self._curve = settings(address, token, server_key)
        self._ctx = zmq.Context()
        self._link: Link | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._cancels: list[int] = []
        self._drain_scheduled = False
        self._connecting: asyncio.Future | None = None
        self._up = asyncio.Event()
        self._regions: list = []
        self._closed = False
        self.server: str | None = None
        self.max_request_bytes = 1 << 62
        self.last_reply = None   # the last infer reply (infer_with_meta reads its own)

    async def __aenter__(self) -> "AsyncClient":
        await self.connect()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    @property
    def inflight(self) -> int:
        """Requests sent and not yet answered."""
        return len(self._pending)

    # ---- connection --------------------------------------------------------------------------

    async def connect(self) -> None:
        """Connect and say hello (idempotent); ConnectError when no broker answers in connect_timeout
        (a later call tries again)."""
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
        try:
            await asyncio.shield(self._connecting)
        except BaseException:
            if self._connecting.done():
                self._connecting = None
            raise

    async def _connect(self) -> None:
        if self._closed:
            raise RuntimeError("tgw AsyncClient is closed")
        path = ipc_path(self.address)
        if path is not None and not os.path.exists(path):
            raise ConnectError(f"no tgw broker at {self.address}: {path} does not exist")
        self._loop = asyncio.get_running_loop()
        link = self._link = Link(self._ctx, self.address, self.liveness, self._curve, self._server_key, unbounded=True)
        self._loop.add_reader(link.sock.getsockopt(zmq.FD), self._drain)
        self._loop.add_reader(link.monitor.getsockopt(zmq.FD), self._on_monitor)
        self._on_monitor()
        try:
            await asyncio.wait_for(self._up.wait(), self.connect_timeout)
            reply, _ = await self._request(Hello(v=PROTOCOL_VERSION, id=next(self._ids), client="tgw.client/py-async",
                                                 token=self.token), [], self.connect_timeout)
        except BaseException as exc:
            self._detach()
            if isinstance(exc, TgwError) and exc.code not in (Code.DEADLINE_EXCEEDED, Code.UNAVAILABLE) or \
                    not isinstance(exc, (asyncio.TimeoutError, TgwError)):
                raise
            hint = " (a wrong server key looks the same: check TGW_SERVER_KEY)" if self._curve else ""
            raise ConnectError(f"no tgw broker answered at {self.address} within "
                               f"{self.connect_timeout:g}s{hint}") from None
        self.server, self.max_request_bytes = reply.server, reply.max_request_bytes

    def _detach(self, linger_ms: int = 0) -> None:
        """Stop reading the socket and close it."""
        link, self._link = self._link, None
        if link is not None:
            self._loop.remove_reader(link.sock.getsockopt(zmq.FD))
            self._loop.remove_reader(link.monitor.getsockopt(zmq.FD))
            link.close(linger_ms)

    async def close(self) -> None:
        """Unregister regions, say goodbye (the broker drops this client's queued requests),
        fail the calls still waiting (UnavailableError) and close the socket."""
        if self._closed:
            return
        self._closed = True
        for region in self._regions:
            await region.aclose()
        link = self._link
        if link is not None:
            link.events()
            self._fail_all(lambda rid: fail(Code.UNAVAILABLE, "the client was closed", source="client",
                                            request_id=rid))
            if link.up:
                try:
                    link.sock.send(encode(Goodbye(v=PROTOCOL_VERSION, token=self.token)), NOBLOCK)
                except zmq.ZMQError:
                    pass
            self._detach(GOODBYE_LINGER_MS if link.up else 0)
        self._ctx.term()

    def _on_monitor(self) -> None:
        link = self._link
        if link is None:
            return
        if link.events():
            self._fail_all(link.lost_error)
        if link.up:
            self._up.set()
        else:
            self._up.clear()

    def _fail_all(self, error) -> None:
        pending, self._pending = self._pending, {}
        for rid, fut in pending.items():
            if not fut.done():
                fut.set_exception(error(rid))

    # ---- calls -------------------------------------------------------------------------------

    async def infer(self, model: str, inputs: dict[str, Any], *, retry: RetryPolicy | None = None,
                    **options) -> dict[str, Any]:
        """As Client.infer, awaited (the same options and errors). Cancelling the awaiting task
        cancels the request at the broker if it is still queued."""
        return (await self.infer_with_meta(model, inputs, retry=retry, **options)).outputs

    async def infer_with_meta(self, model: str, inputs: dict[str, Any], *, retry: RetryPolicy | None = None,
                              **options) -> InferResult:
        """As Client.infer_with_meta, awaited."""
        if self._link is None:
            await self.connect()
        region = options.get("region")
        tries = Attempts(retry if retry is not None else self.retry, options.pop("timeout", None), region)
        while True:
            call = prepare(next(self._ids), model, inputs, token=self.token, default_tenant=self.tenant,
                           address=self.address, timeout=tries.left(), **options)
            try:
                reply, frames = await self._infer(call)
                self.last_reply = reply
                return InferResult(call.outputs(reply, frames), reply.model, reply.version, reply.traceparent)
            except Exception as exc:
                call.end(exc)
                wait = tries.after(exc)
                if wait is None:
                    raise
            finally:
                call.end()
            if wait is REREGISTER:   # the broker restarted
                await region.areregister()
            else:
                await asyncio.sleep(wait)   # the policy's back-off, before the next try

    def stream(self, model: str, *, window: int = 64, **options):
        """An async streaming session (client.stream.AsyncStream): `await s.send(inputs, tag)`,
        `async for result in s`; at most `window` outstanding."""
        from .stream import AsyncStream
        return AsyncStream(self, model, window, options)

    async def region(self, nbytes: int, **options):
        """As Client.region, awaited."""
        from .regions import Region
        if self._link is None:
            await self.connect()
        region = await Region.open_async(self._control_call, nbytes, **options)
        self._regions.append(region)
        return region

    async def models(self) -> list[dict]:
        return [model_dict(m) for m in (await self._control_call(ListModels(v=PROTOCOL_VERSION))).models]

    async def metadata(self, model: str | None = None) -> list[dict]:
        return [as_builtins(m) for m in (await self._control_call(Metadata(v=PROTOCOL_VERSION, model=model))).models]

    async def health(self) -> dict:
        return health_dict(await self._control_call(Health(v=PROTOCOL_VERSION)))

    async def stats(self) -> dict:
        return stats_dict(await self._control_call(Stats(v=PROTOCOL_VERSION)))

    async def status(self) -> dict:
        return status_dict(await self._control_call(Status(v=PROTOCOL_VERSION)))

    # ---- plumbing ----------------------------------------------------------------------------

    async def _control_call(self, msg, timeout: float | None = None):
        if self._link is None:
            await self.connect()
        msg.id, msg.token = next(self._ids), self.token
        return (await self._request(msg, [], timeout or self.connect_timeout))[0]

    async def _infer(self, call: Call):
        if max(call.declared, call.sent) > self.max_request_bytes:
            raise fail(Code.PAYLOAD_TOO_LARGE, f"request carries {max(call.declared, call.sent)} bytes of tensors; "
                       f"the broker's limit is {self.max_request_bytes} (server.max_request_bytes)",
                       limit=self.max_request_bytes)
        wait = NO_TIMEOUT_WAIT_S if call.timeout is None else call.timeout + REPLY_GRACE_S
        return await self._request(call.msg, call.frames, wait, call.sent)

    async def _request(self, msg, frames: list, wait_s: float, nbytes: int | None = None):
        """Send `msg` and its frames, await the reply: (reply, tensor frames), or the error raised."""
        loop, rid = self._loop, msg.id
        deadline = loop.time() + wait_s
        await self._send(msg, frames, deadline, nbytes)
        fut = self._pending[rid] = loop.create_future()
        timer = loop.call_at(deadline, self._expire, rid, wait_s)
        try:
            return await fut
        except asyncio.CancelledError:
            self._abandon(rid)
            raise
        except TgwError as err:
            if err.code is Code.DEADLINE_EXCEEDED and err.details.get("source") == "client":
                self._abandon(rid)
            raise
        finally:
            timer.cancel()
            self._pending.pop(rid, None)

    async def _send(self, msg, frames: list, deadline: float, nbytes: int | None) -> None:
        """Send once the connection is up, waiting for it at most min(liveness, the deadline)."""
        copy = (sum(len(f) for f in frames) if nbytes is None else nbytes) < ZERO_COPY_MIN
        send, header = self._link.sock.send, encode(msg)
        for _ in range(2):
            try:
                if frames:
                    send(header, SNDMORE | NOBLOCK, copy=copy)
                    for f in frames[:-1]:
                        send(f, SNDMORE, copy=copy)
                    send(frames[-1], 0, copy=copy)
                else:
                    send(header, NOBLOCK, copy=copy)
                self._kick()
                return
            except zmq.Again:
                waited = max(0.0, min(deadline - self._loop.time(), self.liveness or 1e9))
                try:
                    await asyncio.wait_for(self._up.wait(), waited)
                except asyncio.TimeoutError:
                    raise self._link.down_error(waited) from None

    def _expire(self, rid: int, wait_s: float) -> None:
        fut = self._pending.get(rid)
        if fut is not None and not fut.done():
            fut.set_exception(fail(Code.DEADLINE_EXCEEDED, f"no reply from {self.address} within {wait_s:.1f}s",
                                   request_id=rid, source="client"))

    def _abandon(self, rid: int) -> None:
        """Tell the broker, with the others of this loop turn, that nobody waits for `rid`."""
        if not self._cancels and not self._closed:
            self._loop.call_soon(self._send_cancels)
        self._cancels.append(rid)

    def _send_cancels(self) -> None:
        ids, self._cancels = self._cancels, []
        if ids and not self._closed:
            try:
                self._link.sock.send(encode(Cancel(v=PROTOCOL_VERSION, id=next(self._ids), ids=ids,
                                                   token=self.token)), NOBLOCK)
                self._kick()
            except zmq.ZMQError:   # no connection: the broker that had them is gone anyway
                pass

    def _kick(self) -> None:
        if not self._drain_scheduled:
            self._drain_scheduled = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._drain_scheduled = False
        if self._link is None:
            return
        sock = self._link.sock
        pending = self._pending
        while sock.getsockopt(EVENTS) & POLLIN:
            try:
                reply, parts = read_reply(sock)
            except TgwError as err:
                log.warning("tgw AsyncClient: %s", err)
                continue
            fut = pending.pop(reply.id, None)
            if fut is None or fut.done():   # a cancel's answer, or a late reply to a call that gave up
                for region in self._regions:
                    region.late_reply(reply.id)
                continue
            if isinstance(reply, ErrorReply):
                fut.set_exception(error_from_body(reply.error))
            else:
                fut.set_result((reply, parts))
