"""The streams Client.generate and AsyncClient.generate return (docs/CLIENT.md, "Generation").

    for token in client.generate("tiny-gpt", {"prompt": ids}, max_outputs=32):
        ...
    async for token in aclient.generate("tiny-gpt", {"prompt": ids}):
        ...

Client: each live generation has a socket of its own (a Link taken from the client's idle ones,
or a new one), so a stream may be read from any thread, one at a time, and many run at once in
as many threads. It goes back to the idle ones once the broker ended the stream (nothing more
comes for it); a stream the client ends (a close, its deadline) closes its socket after the
cancel went out, so the outputs still on their way cannot crowd the next stream's connection. AsyncClient: every generation shares the client's one
connection, whose reader routes each `gen`, `gen_end` or `error` to its stream by request id
(client/async_link.py), holding a slot of the broker's per-caller cap until the stream ends.

Closing a stream before its end (close/aclose, leaving its `with` block, dropping the last
reference to it, its deadline passing in the client, or - async - cancelling the task that
awaits it) sends `cancel` for it: the broker ends the sequence and its worker frees the slot
before its next step. What still comes for it is dropped quietly.
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from tgw.shm.errors import Code, fail

from .generation import GenerationEnd, Sequence, generate_params, one_row
from .request import prepare
from .transport import EVENTS, NO_TIMEOUT_WAIT_S, POLLIN, check_size, read_reply, reply_wait


def declared_ranks(models: list) -> dict[str, dict[str, int]]:
    """model -> its inputs' declared ranks (without the batch dim), from a `models` reply."""
    return {m.name: {t.name: len(t.shape) for t in m.inputs} for m in models}


def _prepare(req_id: int, client, ranks: dict | None, model: str, inputs: Any, params, options: dict):
    call = prepare(req_id, model, one_row(inputs, ranks), token=client.token, default_tenant=client.tenant,
                   address=client.address, **options)
    call.msg.generate = params
    check_size(call.declared, call.sent, client.max_request_bytes)
    return call


def _expired(rid: int, waited: float):
    return fail(Code.DEADLINE_EXCEEDED, f"no output from the broker within {waited:.1f}s", request_id=rid,
                source="client")


class Generation:
    """A generation's outputs, as an iterator (Client.generate). `final` holds its GenerationEnd
    once the iteration is over; an error mid-stream is raised by the iteration, after the outputs
    that came before it."""

    def __init__(self, client, model: str, inputs: Any, *, max_outputs=None, sampling=None, seed=None,
                 timeout: float | None = None, **options):
        params = generate_params(max_outputs, sampling, seed)
        self._client = client
        call = _prepare(client.next_id(), client, client.input_ranks(model), model, inputs, params,
                        dict(options, timeout=timeout))
        self._seq = Sequence(call.msg.id)
        self._timeout = timeout
        self._until = None if timeout is None else time.monotonic() + reply_wait(timeout)
        self._closed = False
        # a read and a close from another thread, one at a time (that close waits for the read's output)
        self._lock = threading.RLock()
        link = self._link = client.generation_link()
        try:
            client.send(link, call.msg, call.frames, reply_wait(timeout), call.sent)
        except BaseException:
            self._link = None
            client.generation_link_done(link, reuse=False)
            raise
        self._losses = link.losses

    @property
    def id(self) -> int:
        """The request id (what a `cancel` names)."""
        return self._seq.id

    @property
    def final(self) -> GenerationEnd | None:
        """How it ended, once every output was taken; None before, after an error or a close."""
        return self._seq.final

    def __enter__(self) -> "Generation":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __iter__(self) -> "Generation":
        return self

    def __next__(self):
        with self._lock:
            seq = self._seq
            while True:
                if self._closed:
                    raise StopIteration
                try:
                    ready, item = seq.take()
                except BaseException:
                    self._release()
                    raise
                if ready:
                    return item
                self._pump()

    def close(self) -> None:
        """Stop the generation: the broker is told (`cancel`) unless it has ended already; the
        outputs not taken yet are dropped. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._link is not None and not self._seq.answered:
                self._client._withdraw(self._link, self._seq.id)
            self._release()

    def __del__(self):
        try:
            if not self._closed:
                self.close()
        except Exception:   # noqa: BLE001 - a collected stream of a closed client or a dying interpreter
            pass

    def _release(self) -> None:
        link, self._link = self._link, None
        if link is not None:
            self._client.generation_link_done(link, reuse=self._seq.answered)

    def _pump(self) -> None:
        """Read the stream's socket until this sequence has an output or has ended."""
        seq, link = self._seq, self._link
        sock = link.sock
        until = self._until if self._until is not None else time.monotonic() + NO_TIMEOUT_WAIT_S
        while not seq.items and not seq.ended:
            if sock.closed:
                return seq.fail(fail(Code.UNAVAILABLE, "the client was closed", source="client", request_id=seq.id))
            if not sock.getsockopt(EVENTS) & POLLIN:
                if link.events() or link.losses != self._losses:
                    return seq.fail(link.lost_error(seq.id))
                left = until - time.monotonic()
                if left <= 0:
                    self._client._withdraw(link, seq.id)
                    waited = reply_wait(self._timeout) if self._until is not None else NO_TIMEOUT_WAIT_S
                    return seq.fail(_expired(seq.id, waited))
                link.wait(int(left * 1000) + 1)
                continue
            try:
                reply, parts = read_reply(sock)
            except Exception as err:   # noqa: BLE001 - undecodable: this stream's error
                return seq.fail(err)
            if reply.id == seq.id:
                seq.feed(reply, parts)
            else:   # a late message for a stream this socket served before, or a cancel's answer
                self._client.late_reply(reply.id)


class AsyncGeneration:
    """A generation's outputs, as an async iterator (AsyncClient.generate): the request goes out
    at the first `__anext__` (or `async with`). `final` as Generation's."""

    def __init__(self, client, model: str, inputs: Any, *, max_outputs=None, sampling=None, seed=None,
                 timeout: float | None = None, **options):
        self._params = generate_params(max_outputs, sampling, seed)   # a bad argument fails here, at once
        self._client, self._model, self._inputs, self._timeout = client, model, inputs, timeout
        self._options = dict(options, timeout=timeout)
        self._seq: Sequence | None = None
        self._link = None
        self._held = False          # a slot of the broker's per-caller cap
        self._waiter: asyncio.Future | None = None   # the reader's, while it waits for news
        self._until: float | None = None
        self._closed = False

    @property
    def id(self) -> int | None:
        return self._seq.id if self._seq is not None else None

    @property
    def final(self) -> GenerationEnd | None:
        return self._seq.final if self._seq is not None else None

    async def __aenter__(self) -> "AsyncGeneration":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def __aiter__(self) -> "AsyncGeneration":
        return self

    async def start(self) -> None:
        """Send the request (once); the first `__anext__` does it when nobody did."""
        if self._seq is not None or self._closed:
            return
        client = self._client
        ranks = await client.input_ranks(self._model)
        call = _prepare(client.next_id(), client, ranks, self._model, self._inputs, self._params, self._options)
        self._inputs = None
        seq = self._seq = Sequence(call.msg.id)
        link = self._link = client.generation_link()
        wait_s = reply_wait(self._timeout)
        self._until = None if self._timeout is None else link.loop.time() + wait_s
        try:
            self._held = await link.open_stream(call.msg, call.frames, wait_s, call.sent, self)
        except BaseException as err:
            self._link = None
            if isinstance(err, asyncio.CancelledError):   # its task gave up before it went out
                self._closed = True
            else:
                seq.fail(err)
            raise

    async def __anext__(self):
        if self._seq is None and not self._closed:
            await self.start()
        seq = self._seq
        while True:
            if self._closed:
                raise StopAsyncIteration
            try:
                ready, item = seq.take()
            except StopIteration:
                self._end(cancel=False)
                raise StopAsyncIteration from None
            except BaseException:
                self._end(cancel=False)
                raise
            if ready:
                return item
            await self._wait()

    async def aclose(self) -> None:
        """As Generation.close."""
        self.close()

    def close(self) -> None:
        """aclose, callable without awaiting (from the event loop's thread)."""
        if self._closed:
            return
        self._closed = True
        self._end(cancel=self._seq is not None and not self._seq.ended)

    def __del__(self):
        link = self._link
        if link is None or self._closed:
            return
        try:   # dropped unfinished: cancel it from the loop (the GC may run anywhere)
            link.loop.call_soon_threadsafe(link.end_stream, self._seq.id, self._held, not self._seq.ended)
        except Exception:   # noqa: BLE001 - its loop is closed: the connection is gone with it
            pass

    # ---- the link's side ---------------------------------------------------------------------

    def feed(self, reply, parts: list) -> None:
        self._seq.feed(reply, parts)
        self._wake(True)

    def fail(self, error: BaseException) -> None:
        self._seq.fail(error)
        self._wake(True)

    def _wake(self, news: bool) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(news)

    # ---- plumbing ----------------------------------------------------------------------------

    def _end(self, cancel: bool) -> None:
        link, self._link = self._link, None
        if link is not None:
            link.end_stream(self._seq.id, self._held, cancel)
            self._held = False

    async def _wait(self) -> None:
        """Until something came for this stream; past the deadline, it is cancelled and fails.
        (A future and a timer: wait_for's task per output would cost more than the output.)"""
        seq, loop = self._seq, asyncio.get_running_loop()
        until = self._until if self._until is not None else loop.time() + NO_TIMEOUT_WAIT_S
        waiter = self._waiter = loop.create_future()
        timer = loop.call_at(until, self._wake, False)
        try:
            news = await waiter
        except asyncio.CancelledError:   # nobody will read it: the broker stops it
            self.close()
            raise
        finally:
            timer.cancel()
            self._waiter = None
        if not news:
            waited = reply_wait(self._timeout) if self._until is not None else NO_TIMEOUT_WAIT_S
            self._end(cancel=True)
            seq.fail(_expired(seq.id, waited))
