"""AsyncClient's connection on the event loop: one DEALER socket, its replies matched to the
futures waiting for them by request id.

The socket's FD is edge-triggered: it is drained until empty, and drained once more after each
send, which may consume the edge. A request nobody waits for any more (its task cancelled, its
timeout passed) is cancelled at the broker, the cancels of one loop turn in one message, so a
request still queued never runs. A lost connection fails every waiting call with
UnavailableError (client/connection.py). Infers beyond the broker's per-caller cap wait on this
side for a slot (client/caller_cap.py).
"""
from __future__ import annotations

import asyncio
import logging
import math
from typing import Callable, Iterator

import zmq

from tgw.shm.errors import Code, TgwError, error_from_body, fail
from tgw.shm.wire import PROTOCOL_VERSION, Cancel, ErrorReply, encode

from .caller_cap import CallerCap
from .connection import Link
from .transport import EVENTS, NOBLOCK, POLLIN, read_reply, send_request

log = logging.getLogger("tgw.client")


class AsyncLink:
    def __init__(self, ctx: zmq.Context, address: str, liveness: float | None, curve, server_key, *,
                 token: str | None, ids: Iterator[int], on_late: Callable[[int], None]):
        """`ids`: the client's request ids (a cancel takes one); `on_late(request_id)`: a reply came
        that nobody waits for."""
        self.address, self.liveness, self.token, self._ids, self._on_late = address, liveness, token, ids, on_late
        self.loop = asyncio.get_running_loop()
        self.pending: dict[int, asyncio.Future] = {}   # request id -> the caller's future
        self.streams: dict[int, object] = {}            # request id -> its generation (gen_stream.AsyncGeneration)
        self.up = asyncio.Event()                       # the connection's handshake is done
        self.closed = False
        self._cancels: list[int] = []
        self._cancel_slots = 0   # of the requests in _cancels, those holding a slot of the cap
        self.cap = CallerCap(self.loop)   # its limit set from the hello (AsyncClient._connect)
        self._cancelled: dict[int, list[int]] = {}   # id of a cancel sent -> the requests it withdraws
        self._drain_scheduled = False
        link = self.link = Link(ctx, address, liveness, curve, server_key, unbounded=True)
        try:
            self.loop.add_reader(link.sock.getsockopt(zmq.FD), self._drain)
            self.loop.add_reader(link.monitor.getsockopt(zmq.FD), self._on_monitor)
        except BaseException:
            self.close()
            raise
        self._on_monitor()

    def close(self, linger_ms: int = 0) -> None:
        """Stop reading the socket and close it (`linger_ms`: for a last goodbye)."""
        if self.closed:
            return
        self.closed = True
        link = self.link
        if not link.sock.closed:
            self.loop.remove_reader(link.sock.getsockopt(zmq.FD))
            self.loop.remove_reader(link.monitor.getsockopt(zmq.FD))
        link.close(linger_ms)

    def fail_all(self, error: Callable[[int], BaseException]) -> None:
        """Fail every waiting call with `error(request_id)`."""
        pending, self.pending = self.pending, {}
        for rid, fut in pending.items():
            if not fut.done():
                fut.set_exception(error(rid))
        for rid, stream in list(self.streams.items()):   # each ends (and leaves) as its reader sees it
            stream.fail(error(rid))

    async def open_stream(self, msg, frames: list, wait_s: float, nbytes: int | None, stream) -> bool:
        """Send a generation's request, its messages routed to `stream` (feed, fail) until
        end_stream; returns whether it holds a slot of the cap (held until end_stream)."""
        deadline = self.loop.time() + wait_s
        held = self.cap.limit is not None
        if held and not self.cap.take():
            await self._slot(msg, deadline)
        self.streams[msg.id] = stream
        try:
            await self._send(msg, frames, deadline, nbytes)
        except BaseException:
            self.end_stream(msg.id, held, cancel=False)
            raise
        return held

    def end_stream(self, rid: int, held: bool, cancel: bool) -> None:
        """A generation is over for its reader: `cancel` tells the broker (it had not ended)."""
        if self.streams.pop(rid, None) is None and not held:
            return
        if cancel:
            self._abandon(rid, held)
        elif held:
            self.cap.release()

    async def request(self, msg, frames: list, wait_s: float, nbytes: int | None = None, capped: bool = False):
        """Send `msg` and its frames, await the reply: (reply, tensor frames), or the error raised.
        `capped` (an infer): sent once a slot of the broker's per-caller cap is free."""
        loop, rid = self.loop, msg.id
        deadline = loop.time() + wait_s
        held = capped and self.cap.limit is not None
        if held and not self.cap.take():   # past the cap: wait here for a slot
            await self._slot(msg, deadline)
        try:
            await self._send(msg, frames, deadline, nbytes)
            fut = self.pending[rid] = loop.create_future()
            timer = loop.call_at(deadline, self._expire, rid, wait_s)
            try:
                return await fut
            except asyncio.CancelledError:
                self._abandon(rid, held)
                held = False   # freed once the cancel is out
                raise
            except TgwError as err:
                if err.code is Code.DEADLINE_EXCEEDED and err.details.get("source") == "client":
                    self._abandon(rid, held)
                    held = False
                raise
            finally:
                timer.cancel()
                self.pending.pop(rid, None)
        finally:
            if held:
                self.cap.release()

    async def _slot(self, msg, deadline: float) -> None:
        """Wait for a slot of the cap, at most until the request's own timeout; the time waited
        is taken off the timeout the broker counts from its receipt."""
        start = self.loop.time()
        until = deadline if msg.timeout_ms is None else min(deadline, start + msg.timeout_ms / 1000)
        await self.cap.acquire(until, msg.id)
        waited_ms = (self.loop.time() - start) * 1000
        if msg.timeout_ms and waited_ms >= 1:
            msg.timeout_ms = max(1, math.ceil(msg.timeout_ms - waited_ms))

    async def _send(self, msg, frames: list, deadline: float, nbytes: int | None) -> None:
        """Send once the connection is up, waiting for it at most min(liveness, the deadline)."""
        header = encode(msg)
        for _ in range(2):
            try:
                send_request(self.link.sock, header, frames, nbytes)
                self._kick()
                return
            except zmq.Again:
                waited = max(0.0, min(deadline - self.loop.time(), self.liveness or 1e9))
                try:
                    await asyncio.wait_for(self.up.wait(), waited)
                except asyncio.TimeoutError:
                    raise self.link.down_error(waited) from None

    def _on_monitor(self) -> None:
        if self.closed:
            return
        if self.link.events():
            self.fail_all(self.link.lost_error)
        if self.link.up:
            self.up.set()
        else:
            self.up.clear()

    def _expire(self, rid: int, wait_s: float) -> None:
        fut = self.pending.get(rid)
        if fut is not None and not fut.done():
            fut.set_exception(fail(Code.DEADLINE_EXCEEDED, f"no reply from {self.address} within {wait_s:.1f}s",
                                   request_id=rid, source="client"))

    def _abandon(self, rid: int, slot: bool = False) -> None:
        """Tell the broker, with the others of this loop turn, that nobody waits for `rid`
        (`slot`: it holds a slot of the cap, freed once the cancel is out)."""
        if not self._cancels and not self.closed:
            self.loop.call_soon(self._send_cancels)
        self._cancels.append(rid)
        self._cancel_slots += slot

    def _send_cancels(self) -> None:
        ids, self._cancels = self._cancels, []
        slots, self._cancel_slots = self._cancel_slots, 0
        try:
            self._send_cancel(ids)
        finally:   # out (or no connection: the broker that counted them is gone): the slots are free
            self.cap.release(slots)

    def _send_cancel(self, ids: list[int]) -> None:
        if ids and not self.closed:
            cancel_id = next(self._ids)
            try:
                self.link.sock.send(encode(Cancel(v=PROTOCOL_VERSION, id=cancel_id, ids=ids, token=self.token)),
                                    NOBLOCK)
                self._kick()
            except zmq.ZMQError:   # no connection: the broker that had them is gone anyway
                return
            if len(self._cancelled) >= 4096:   # answers a lost connection never brought: forget the oldest
                self._cancelled.pop(next(iter(self._cancelled)), None)
            self._cancelled[cancel_id] = ids

    def _kick(self) -> None:
        if not self._drain_scheduled:
            self._drain_scheduled = True
            self.loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._drain_scheduled = False
        if self.closed:
            return
        sock, pending = self.link.sock, self.pending
        while sock.getsockopt(EVENTS) & POLLIN:
            try:
                reply, parts = read_reply(sock)
            except TgwError as err:
                log.warning("tgw AsyncClient: %s", err)
                continue
            stream = self.streams.get(reply.id)
            if stream is not None:   # a generation's gen, gen_end or error
                stream.feed(reply, parts)
                continue
            fut = pending.pop(reply.id, None)
            if fut is None or fut.done():   # a cancel's answer, or a late reply to a call that gave up
                # the broker answers a withdrawn request never: its cancel's answer stands for it
                for rid in self._cancelled.pop(reply.id, [reply.id]):
                    self._on_late(rid)
                continue
            if isinstance(reply, ErrorReply):
                fut.set_exception(error_from_body(reply.error))
            else:
                fut.set_result((reply, parts))
