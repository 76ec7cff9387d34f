"""Streaming sessions: send many requests to one model, take the results as they complete.

    with client.stream("mlp", window=32, timeout=1.0) as s:
        for i, x in enumerate(xs):
            s.send({"x": x}, tag=i)          # blocks while 32 are outstanding
            for r in s.ready():              # whatever completed meanwhile, never blocks
                use(r.tag, r.outputs)
        for r in s:                          # the rest, as they complete (waits)
            use(r.tag, r.result())           # result(): the outputs, or raises the error

    async with aclient.stream("mlp", window=32) as s:
        await s.send({"x": x}, tag=i)        # waits while the window is full
        async for r in s: ...                # ends once closed and everything is answered

Results come in completion order (requests of different batches and workers finish
independently), each with the tag it was sent with (default: a counter). One failed request is
one result with its error; the session goes on. Leaving the `with` block (close) waits for what
is outstanding; results not yet taken can still be taken after it (ready(), iteration).
"""
from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from typing import Any, NamedTuple

import zmq

from tgw.shm.errors import Code, TgwError, error_from_body, fail
from tgw.shm.wire import ErrorReply

from .request import Call, prepare
from .transport import EVENTS, POLLIN, check_size, read_reply, reply_wait


class StreamResult(NamedTuple):
    tag: Any
    outputs: dict | None        # None when the request failed
    error: Exception | None     # a TgwError, or what the request's inputs raised
    version: str | None = None  # the version that ran

    def result(self) -> dict:
        """The outputs, or raise the request's error."""
        if self.error is not None:
            raise self.error
        return self.outputs


def _check_window(window: int) -> int:
    if not isinstance(window, int) or window < 1:
        raise fail(Code.INVALID_ARGUMENT, f"window must be a positive int, got {window!r}")
    return window


class Stream:
    """The synchronous session (Client.stream), on a socket of its own: use it from one thread."""

    def __init__(self, client, model: str, window: int, options: dict):
        self.client, self.model, self.options = client, model, options
        self.window = _check_window(window)
        self._tags = itertools.count()
        self._outstanding: dict[int, tuple[Any, Call]] = {}   # request id -> (tag, call)
        self._done: deque[StreamResult] = deque()
        self._link = client.new_link()
        cap = self._link.max_inflight   # the broker refuses past its per-caller cap: the window never exceeds it
        self._room = min(self.window, cap) if cap else self.window
        self._closed = False

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def outstanding(self) -> int:
        return len(self._outstanding)

    def send(self, inputs: dict, tag: Any = None, **overrides) -> Any:
        """Send one request (`overrides`: infer options for this one); returns its tag. Blocks
        while `window` requests (or the broker's per-caller cap, when smaller) are outstanding,
        taking their results in meanwhile."""
        if self._closed:
            raise RuntimeError("stream is closed")
        while len(self._outstanding) >= self._room:
            self._receive(block=True)
        tag = next(self._tags) if tag is None else tag
        c = self.client
        call = prepare(c.next_id(), self.model, inputs, token=c.token, default_tenant=c.tenant, address=c.address,
                       **{**self.options, **overrides})
        check_size(call.declared, call.sent, c.max_request_bytes)
        try:
            c.send(self._link, call.msg, call.frames, self._wait(call), call.sent)
        except BaseException:
            call.end()
            raise
        self._outstanding[call.msg.id] = (tag, call)
        return tag

    def ready(self) -> list[StreamResult]:
        """The results completed so far, without waiting."""
        self._receive(block=False)
        out, self._done = list(self._done), deque()
        return out

    def next(self, timeout: float | None = None) -> StreamResult | None:
        """The next completed result, waiting up to `timeout` (None: as long as a request is
        outstanding); None when nothing is outstanding or the wait ran out."""
        if not self._done and self._outstanding:
            self._receive(block=True, timeout=timeout)
        return self._done.popleft() if self._done else None

    def __iter__(self):
        while True:
            r = self.next()
            if r is None:
                return
            yield r

    def close(self) -> None:
        """Wait for every outstanding request (their results stay to be taken) and close the socket."""
        if self._closed:
            return
        try:
            while self._outstanding:
                self._receive(block=True)
        finally:
            self._closed = True
            self.client.drop_link(self._link)

    def _wait(self, call: Call) -> float:
        return reply_wait(call.timeout)

    def _receive(self, block: bool, timeout: float | None = None) -> None:
        """Take the replies waiting (at least one when `block`, within `timeout` or, by default, the
        longest wait of the outstanding requests); a lost connection fails every outstanding one."""
        if self._closed:
            return
        link, sock = self._link, self._link.sock
        if block and not sock.getsockopt(EVENTS) & POLLIN:
            wait = timeout if timeout is not None else max(self._wait(call) for _, call in self._outstanding.values())
            end = time.monotonic() + wait
            while not sock.getsockopt(EVENTS) & POLLIN:
                if link.events():
                    return self._fail_all(link.lost_error)
                left = end - time.monotonic()
                if left <= 0:
                    if timeout is None:   # nothing within the longest timeout: the broker is not answering
                        self._fail_all(lambda rid: fail(Code.DEADLINE_EXCEEDED, f"no reply within {wait:.1f}s",
                                                        request_id=rid, source="client"))
                    return
                zmq.zmq_poll([(sock, POLLIN), (link.monitor, POLLIN)], int(left * 1000) + 1)
        while sock.getsockopt(EVENTS) & POLLIN:
            reply, parts = read_reply(sock)
            entry = self._outstanding.pop(reply.id, None)
            if entry is not None:
                self._done.append(_result(entry, reply, parts))

    def _fail_all(self, error) -> None:
        for rid, (tag, call) in list(self._outstanding.items()):
            call.end()
            self._done.append(StreamResult(tag, None, error(rid)))
        self._outstanding.clear()


def _result(entry: tuple, reply, parts: list) -> StreamResult:
    tag, call = entry
    try:
        if isinstance(reply, ErrorReply):
            raise error_from_body(reply.error)
        result = StreamResult(tag, call.outputs(reply, parts), None, reply.version)
    except TgwError as err:
        call.end(err)
        return StreamResult(tag, None, err)
    call.end()
    return result


class AsyncStream:
    """The asyncio session (AsyncClient.stream), on the client's connection."""

    def __init__(self, client, model: str, window: int, options: dict):
        self.client, self.model, self.options = client, model, options
        self.window = _check_window(window)
        self._tags = itertools.count()
        self._slots = asyncio.Semaphore(self.window)
        self._results: asyncio.Queue[StreamResult] = asyncio.Queue()
        self._tasks: set[asyncio.Task] = set()
        self._outstanding = 0               # sent, result not yet queued
        self._changed = asyncio.Event()   # a result came, or the session closes
        self._closing = False

    async def __aenter__(self) -> "AsyncStream":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    @property
    def outstanding(self) -> int:
        return self._outstanding

    async def send(self, inputs: dict, tag: Any = None, **overrides) -> Any:
        """Send one request; waits while `window` are outstanding. Returns its tag."""
        if self._closing:
            raise RuntimeError("stream is closed")
        await self._slots.acquire()
        self._outstanding += 1
        tag = next(self._tags) if tag is None else tag
        task = asyncio.ensure_future(self._one(tag, inputs, {**self.options, **overrides}))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return tag

    async def _one(self, tag: Any, inputs: dict, options: dict) -> None:
        try:
            r = await self.client.infer_with_meta(self.model, inputs, **options)
            result = StreamResult(tag, r.outputs, None, r.version)
        except Exception as err:  # noqa: BLE001 - a bad input is this request's result, not the session's end
            result = StreamResult(tag, None, err)
        finally:
            self._outstanding -= 1
            self._slots.release()
        self._results.put_nowait(result)
        self._changed.set()

    def __aiter__(self):
        return self

    async def __anext__(self) -> StreamResult:
        """The next completed result; stops once the session is closing and everything is taken
        (iterate in one task while another sends and then closes, or after sending)."""
        while self._results.empty():
            if self._closing and not self._outstanding:
                raise StopAsyncIteration
            self._changed.clear()
            await self._changed.wait()
        return self._results.get_nowait()

    async def close(self) -> None:
        """Wait for every outstanding request; their results stay to be taken by iteration."""
        self._closing = True
        self._changed.set()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._changed.set()
