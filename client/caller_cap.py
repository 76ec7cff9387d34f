"""The broker's per-caller in-flight cap, kept on the client's side of one AsyncClient connection.

The broker answers OVERLOADED (reason client_inflight) past server.max_inflight_per_client
infers admitted and unanswered on one connection, and its hello reply says the cap. An
AsyncClient holds the requests beyond it here, first come first served, and sends each as a slot
frees, so a burst larger than the cap is served rather than refused. A slot is held from the
send until the broker can no longer count the request: its answer came, the connection was lost,
or the cancel that withdraws it went out (a cancel travels before any later infer on the same
socket, so the broker has paid the request back before it reads the next one). A request
cancelled, or past its timeout, while held here is never sent. A broker whose hello names no cap
(one older than the field): nothing is held.
"""
from __future__ import annotations

import asyncio
from collections import deque

from tgw.shm.errors import Code, fail


class CallerCap:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.limit: int | None = None   # the broker's cap, from its hello (None: none known)
        self.held = 0                   # slots held by requests sent and still counted by the broker
        # the requests waiting for a slot, oldest first; a live one exists only while held == limit
        self._waiting: deque[asyncio.Future] = deque()

    @property
    def queued(self) -> int:
        """Requests waiting here for a slot."""
        return sum(1 for f in self._waiting if not f.done())

    def take(self) -> bool:
        """A slot at once, if one is free (then no request waits: every freed slot went to one first)."""
        if self.limit is None:
            return True
        if self.held < self.limit:
            if self._waiting:
                self._waiting.clear()   # only the cancelled and expired are left
            self.held += 1
            return True
        return False

    async def acquire(self, until: float, request_id: int) -> None:
        """A slot for one infer, waited for until loop time `until` (the request's timeout):
        DEADLINE_EXCEEDED (source client, reason client_queue) past it, nothing sent."""
        if self.take():
            return
        fut = self.loop.create_future()
        self._waiting.append(fut)
        timer = self.loop.call_at(until, _expire, fut)
        try:
            granted = await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None and fut.result():
                self.release()   # handed a slot just as its caller gave up: it passes on
            raise
        finally:
            timer.cancel()
        if not granted:
            raise fail(Code.DEADLINE_EXCEEDED, f"the request's timeout passed while it waited in the client for one "
                       f"of the {self.limit} requests in flight the broker allows one connection "
                       "(server.max_inflight_per_client); it was never sent", request_id=request_id,
                       source="client", reason="client_queue")

    def release(self, n: int = 1) -> None:
        """`n` slots free: each goes to the oldest live waiter, else back to the pool."""
        if self.limit is None:
            return
        waiting = self._waiting
        for _ in range(n):
            while waiting:
                fut = waiting.popleft()
                if not fut.done():
                    fut.set_result(True)
                    break
            else:
                self.held = max(0, self.held - 1)

    def fail_waiting(self, error) -> None:
        """Fail every request still waiting for a slot with `error()` (the client is closing)."""
        waiting, self._waiting = self._waiting, deque()
        for fut in waiting:
            if not fut.done():
                fut.set_exception(error())


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(False)
