"""AsyncClient: the tgw client for asyncio (and uvloop): thousands of requests in flight on one
connection, each awaited by its own caller.

    async with AsyncClient() as c:
        y = (await c.infer("mlp", {"x": x}, timeout=1.0))["y"]

The connection, its replies matched to waiting futures and its cancels are client/async_link.py;
infers beyond the broker's per-caller cap (its hello says it) wait in the client for a slot
(client/caller_cap.py), so a burst larger than the cap is served, not refused.
"""
from __future__ import annotations

import asyncio
import itertools
import os
from typing import Any

import zmq

from tgw.shm.errors import Code, TgwError, fail
from tgw.shm.paths import ipc_path
from tgw.shm.wire import PROTOCOL_VERSION, Health, Hello, ListModels, Metadata, Stats, Status, as_builtins

from .async_link import AsyncLink
from .connection import LIVENESS_S
from .request import Call, prepare
from .results import InferResult, health_dict, model_dict, stats_dict, status_dict
from .retry import REREGISTER, Attempts, RetryPolicy
from .settings import CONNECT_TIMEOUT_S, ConnectError, settings
from .transport import check_size, reply_wait, say_goodbye


class AsyncClient:
    def __init__(self, address: str | None = None, *, token: str | None = None,
                 server_key: str | bytes | None = None, connect_timeout: float = CONNECT_TIMEOUT_S,
                 liveness: float | None = LIVENESS_S, retry: RetryPolicy | None = None):
        """The arguments are Client's. Connects on `async with` or `await connect()` (or the
        first call)."""
        self.connect_timeout, self.liveness, self.retry = connect_timeout, liveness, retry
        self.address, self.token, self.tenant, self._server_key, self._curve = settings(address, token, server_key)
        self._ctx = zmq.Context()
        self._link: AsyncLink | None = None
        self._ids = itertools.count(1)
        self._connecting: asyncio.Future | None = None
        self._regions: list = []
        self._closed = False
        self.server: str | None = None
        self.max_request_bytes = 1 << 62
        self.max_inflight_per_client: int | None = None   # the broker's cap, from its hello (None: none said)
        self.last_reply = None   # the last infer reply (infer_with_meta reads its own)
        self._ranks: dict[str, dict[str, int]] = {}   # model -> its inputs' declared ranks (generate's)

    async def __aenter__(self) -> "AsyncClient":
        await self.connect()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    @property
    def inflight(self) -> int:
        """Requests sent and not yet answered."""
        return len(self._link.pending) if self._link is not None else 0

    @property
    def queued(self) -> int:
        """Infers waiting in the client for a slot of the broker's per-caller cap, not yet sent."""
        return self._link.cap.queued if self._link is not None else 0

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
        link = self._link = AsyncLink(self._ctx, self.address, self.liveness, self._curve, self._server_key,
                                      token=self.token, ids=self._ids, on_late=self._late_reply)
        try:
            await asyncio.wait_for(link.up.wait(), self.connect_timeout)
            reply, _ = await link.request(Hello(v=PROTOCOL_VERSION, id=next(self._ids), client="tgw.client/py-async",
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
        self.max_inflight_per_client = link.cap.limit = reply.max_inflight_per_client

    def _detach(self, linger_ms: int = 0) -> None:
        """Stop reading the socket and close it."""
        link, self._link = self._link, None
        if link is not None:
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
            link.cap.fail_waiting(lambda: fail(Code.UNAVAILABLE, "the client was closed before the request was sent",
                                               source="client"))
            link.fail_all(lambda rid: fail(Code.UNAVAILABLE, "the client was closed", source="client",
                                           request_id=rid))
            self._detach(say_goodbye(link.link, self.token))
        self._ctx.term()

    def _late_reply(self, req_id: int) -> None:
        """A reply nobody waits for: what the regions kept for that call may be reused."""
        for region in self._regions:
            region.late_reply(req_id)

    # ---- calls -------------------------------------------------------------------------------

    async def infer(self, model: str, inputs: dict[str, Any], *, retry: RetryPolicy | None = None,
                    **options) -> dict[str, Any]:
        """As Client.infer, awaited (the same options and errors, `sequence_id`, `sequence_start`
        and `sequence_end` among them). Cancelling the awaiting task cancels the request at the
        broker if it is still queued."""
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

    def generate(self, model: str, inputs: Any, *, max_outputs: int | None = None, sampling=None,
                 seed: int | None = None, version: str | None = None, timeout: float | None = None,
                 priority: int = 0, tenant: str | None = None, routing_key: str | None = None,
                 traceparent: str | None = None):
        """As Client.generate, an async iterator (`async for token in c.generate(...)`), on this
        client's one connection; the request goes out at the first step of the iteration (or
        `async with`). `aclose()`, leaving `async with`, dropping the stream, or cancelling the
        task that awaits its next output cancels the generation."""
        from .gen_stream import AsyncGeneration
        return AsyncGeneration(self, model, inputs, max_outputs=max_outputs, sampling=sampling, seed=seed,
                               version=version, timeout=timeout, priority=priority, tenant=tenant,
                               routing_key=routing_key, traceparent=traceparent)

    async def input_ranks(self, model: str) -> dict[str, int] | None:
        """As Client.input_ranks, awaited."""
        ranks = self._ranks.get(model)
        if ranks is None:
            from .gen_stream import declared_ranks
            self._ranks.update(declared_ranks((await self._control_call(ListModels(v=PROTOCOL_VERSION))).models))
            ranks = self._ranks.get(model)
        return ranks

    def next_id(self) -> int:
        return next(self._ids)

    def generation_link(self) -> AsyncLink:
        """The connection generations share (connected: input_ranks asked the broker first)."""
        if self._link is None:
            raise fail(Code.UNAVAILABLE, "the client was closed" if self._closed else "the client is not connected",
                       source="client")
        return self._link

    async def submit(self, model: str, inputs: Any, *, generate: dict | None = None, version: str | None = None,
                     timeout: float | None = None, outputs: list[str] | None = None, priority: int = 0,
                     compress: bool | str = False, tenant: str | None = None, routing_key: str | None = None,
                     traceparent: str | None = None):
        """As Client.submit, awaited: an AsyncJob."""
        from .jobs import AsyncJob, submit_call
        if self._link is None:
            await self.connect()
        ranks = await self.input_ranks(model) if generate is not None else None
        call = submit_call(self, ranks, model, inputs, generate,
                           dict(version=version, timeout=timeout, outputs=outputs, priority=priority,
                                compress=compress, tenant=tenant, routing_key=routing_key, traceparent=traceparent))
        check_size(call.declared, call.sent, self.max_request_bytes)
        reply, _ = await self._link.request(call.msg, call.frames, self.connect_timeout, call.sent)
        return AsyncJob(self, reply.job_id, call.msg.tenant)

    def job(self, job_id: str, *, tenant: str | None = None):
        """As Client.job: an AsyncJob."""
        from .jobs import AsyncJob
        return AsyncJob(self, job_id, tenant if tenant is not None else self.tenant)

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
        return (await self._link.request(msg, [], timeout or self.connect_timeout))[0]

    async def _call_frames(self, msg, wait_s: float):
        if self._link is None:
            await self.connect()
        msg.id, msg.token = next(self._ids), self.token
        return await self._link.request(msg, [], wait_s)

    async def _infer(self, call: Call):
        check_size(call.declared, call.sent, self.max_request_bytes)
        return await self._link.request(call.msg, call.frames, reply_wait(call.timeout), call.sent, capped=True)
