"""Triton's generate extension on the HTTP face: `POST /v2/models/{m}[/versions/{v}]/generate`
(one JSON answer) and `/generate_stream` (server-sent events, one `data:` event per output).

The request's JSON becomes an Infer (generate_json.py) sent through the door with a
StreamCaller (protocol/streaming.py), which the door answers many times for a generator and once
for a plain model. /generate collects every output and answers one object; /generate_stream
writes each output as its own event as it arrives (a GenerateOutputs of several positions is
several events). A failure before the first answer is a JSON error with its HTTP status, as
Triton has it; one after the stream began is an event `data: {"error": ...}` and the end of the
stream. A client that closes its connection (aiohttp cancels the handler) or reads too slowly
(the caller overflows) is withdrawn from the door, which frees its slot at the next step.
"""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

import orjson
from aiohttp import web

from tgw.shm.errors import TgwError
from tgw.shm.wire import GenerateEnd, GenerateOutputs, Infer, InferReply

from tgw.broker.observe.load import HEADER as LOAD_HEADER
from tgw.broker.protocol import kserve
from tgw.broker.protocol.door import DoorPort
from tgw.broker.protocol.errors import TRACEPARENT, bad
from tgw.broker.protocol.streaming import StreamCaller, output_arrays

from . import generate_json
from .answers import json_response

EVENT_STREAM = "text/event-stream; charset=utf-8"
UNREAD = 1024


class HttpStreamCaller(StreamCaller):
    """A generate request's caller: the door answers it once per output (protocol/streaming.py)."""
    __slots__ = ()
    face = "http"


class GenerateRoutes:
    def __init__(self, deps: DoorPort, body: Callable[[web.Request], Awaitable[bytes]],
                 named: Callable[[str, str | None], tuple[str, str | None]], ids, tenant_header: str):
        """`body`: the face's body reader (its size limit); `named`: a path's model and version
        (a numeric alias resolved); `ids`: the face's request numbering."""
        self.deps, self.body, self.named, self.ids, self.tenant_header = deps, body, named, ids, tenant_header

    def routes(self) -> list[tuple[str, str, Callable]]:
        out = []
        for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
            out += [("POST", base + "/generate", self.generate), ("POST", base + "/generate_stream", self.stream)]
        return out

    async def start(self, request: web.Request) -> tuple[HttpStreamCaller, Infer, list[str], str]:
        """Decode the request and send it through the door: its caller, message, the model's
        output names and the version its events name."""
        model = request.match_info["model"]
        try:
            msg, frames, outputs, shown, unread = await self.decode(request, model)
        except TgwError as err:   # counted as the native door counts its refusals
            self.deps.count_error(model, err.code.value)
            raise
        caller = HttpStreamCaller(asyncio.get_running_loop(), unread,
                                  on_overflow=lambda c: self.deps.withdraw(c, "slow_reader"))
        self.deps.infer(caller, msg, frames)   # the door answers refusals through the caller
        return caller, msg, outputs, shown

    async def decode(self, request: web.Request, model: str):
        plan = self.deps.view.pipelines.table.get(model)
        model, version = self.named(model, request.match_info.get("version"))
        unread = UNREAD   # a plain model answers once
        if plan is not None:
            inputs, outputs, generator, shown = plan.inputs, [t.name for t in plan.outputs], False, plan.version
        else:
            entry = self.deps.entry(model)   # MODEL_NOT_FOUND before the body is read
            inputs, outputs, generator = entry.inputs, [t.name for t in entry.outputs], entry.is_generator
            shown = version or entry.default or ""
            if generator:   # a reader this many outputs behind is ended OVERLOADED, as a native one is
                unread = entry.decl.generator.max_unread_outputs
        body = await self.body(request)
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise bad(f"a generate request's body is a JSON object: {exc}") from None
        headers = request.headers
        msg, frames = generate_json.request(doc, inputs, model, version, next(self.ids), generator,
                                            headers.get(kserve.ROUTING_HEADER))
        msg.tenant, msg.traceparent = headers.get(self.tenant_header), headers.get(TRACEPARENT)
        return msg, frames, outputs, shown, unread

    async def generate(self, request: web.Request) -> web.Response:
        """One answer: a generator's outputs collected, or a plain model's result."""
        caller, msg, outputs, _ = await self.start(request)
        chunks = []
        try:
            while True:
                answer, frames = await caller.next()
                if type(answer) is GenerateOutputs:
                    chunks.append(output_arrays(answer, frames))
                elif type(answer) is GenerateEnd:
                    return json_response(generate_json.collected(answer.model, answer.version, chunks, outputs))
                else:
                    return json_response(generate_json.one_shot(answer, frames))
        except BaseException as exc:   # the client closed its connection (aiohttp cancels the handler), a bug
            self.left(caller, exc)
            raise

    async def stream(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events, one per output, each written as it comes."""
        caller, msg, _, shown = await self.start(request)
        try:
            answer, frames = await caller.next()   # an error before any output: a JSON error
        except BaseException as exc:
            self.left(caller, exc)
            raise
        # X-Accel-Buffering: nginx (configs/nginx) passes each event on rather than buffering the stream
        resp = web.StreamResponse(headers={"Content-Type": EVENT_STREAM, "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        if self.deps.load is not None:   # set before the headers go out (the face's wrapper is too late)
            resp.headers[LOAD_HEADER] = self.deps.load.header
        try:
            await resp.prepare(request)
            while True:
                if type(answer) is GenerateOutputs:
                    await resp.write(sse(generate_json.events(msg.model, shown, output_arrays(answer, frames))))
                elif type(answer) is InferReply:
                    await resp.write(sse([generate_json.one_shot(answer, frames)]))
                    break
                else:
                    break
                try:
                    answer, frames = await caller.next()
                except TgwError as err:   # the status went out with the first event: an error event
                    await resp.write(sse([{"error": err.message, "code": err.code.value}]))
                    break
            await resp.write_eof()
        except ConnectionResetError as exc:   # a write found the connection closed: nobody to answer
            self.left(caller, exc)
        except BaseException as exc:
            self.left(caller, exc)
            raise
        return resp

    def left(self, caller: HttpStreamCaller, exc: BaseException) -> None:
        """The handler ends before the caller's last answer: its generation is withdrawn (the
        worker frees the slot at its next step)."""
        if not caller.done:
            gone = isinstance(exc, (asyncio.CancelledError, ConnectionResetError))
            self.deps.withdraw(caller, "disconnected" if gone else "broker_error")


def sse(docs: list[dict]) -> bytes:
    """Server-sent events, one `data:` line each (orjson writes no newline inside)."""
    return b"".join(b"data: " + orjson.dumps(d) + b"\n\n" for d in docs)
