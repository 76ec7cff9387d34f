"""The OpenAI-compatible face's routes, mounted on the HTTP face's port (base_url
http://host:PORT/v1): /v1/models, /v1/models/{model}, /v1/completions, /v1/chat/completions.

Each choice of a request is one generation sent through the door (`port.infer` with a
StreamCaller), so admission, priorities, tenants, routing keys and metrics are every face's. A
streamed answer is server-sent events (`data: {chunk}`, then `data: [DONE]`); a client that
disconnects has its generations withdrawn, and their slots are freed at the next step.
"""
from __future__ import annotations

import asyncio
import hmac
import time
from itertools import count

import numpy as np
import orjson
from aiohttp import web

from tgw.shm.errors import Code, TgwError
from tgw.shm.wire import PROTOCOL_VERSION, GenerateOutputs, Infer, TensorMeta

from tgw.broker.config.schema_models import tokenizer_class
from tgw.broker.observe.load import HEADER as LOAD_HEADER
from tgw.broker.protocol.door import DoorPort
from tgw.broker.protocol.errors import TRACEPARENT
from tgw.broker.protocol.kserve import ROUTING_HEADER, SliceFrame   # a tensor frame as admission reads one
from tgw.broker.protocol.streaming import StreamCaller, output_arrays

from . import translate
from .chat import ChatTemplate, messages_of
from .errors import OpenAiError, from_tgw, invalid
from .text import TextStream

TENANT_HEADER = "tgw-tenant"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Served:
    """One OpenAI model: its registry entry's declaration, tokenizer and chat template."""
    __slots__ = ("decl", "tokenizer", "template", "input", "output")

    def __init__(self, decl, tokenizer, template: ChatTemplate):
        self.decl, self.tokenizer, self.template = decl, tokenizer, template
        self.input, self.output = decl.inputs[0], decl.outputs[0].name


class OpenAiFace:
    """Routes for the HTTP face's app (`routes()`); no listener of its own."""

    def __init__(self, port: DoorPort, max_inflight: int = 1 << 30):
        self.port, self.max_inflight = port, max_inflight
        self.inflight = 0
        self.ids = count(1)
        self.created = int(time.time())
        self._served: dict[tuple, Served] = {}   # (name, id(decl)) -> Served: rebuilt when a reload swaps the decl

    def routes(self) -> list[tuple[str, str, object]]:
        return [("GET", "/v1/models", self.list_models), ("GET", "/v1/models/{model}", self.get_model),
                ("POST", "/v1/completions", self.completions), ("POST", "/v1/chat/completions", self.chat),
                ("*", "/v1/{anything:.*}", self.nowhere)]

    async def nowhere(self, request: web.Request) -> web.Response:
        async def refuse(request):
            raise OpenAiError(f"no such endpoint: {request.method} {request.path} (this server serves /v1/models, "
                              "/v1/completions and /v1/chat/completions)", None, 404, "invalid_request_error",
                              "unknown_url")
        return await self.answer(request, refuse)

    def check(self, models: list[str]) -> None:
        """At start-up: each OpenAI model's tokenizer made and chat template compiled (ValueError)."""
        for name in models:
            self.served(name)

    # ---- models ------------------------------------------------------------------------------

    def names(self) -> list[str]:
        return sorted(name for name, e in self.port.view.models.items()
                      if not e.removed and e.decl.generator is not None and e.decl.generator.tokenizer)

    def served(self, name: str) -> Served:
        """The model `name` if it is an OpenAI model (404 in OpenAI's shape if not)."""
        entry = self.port.view.models.get(name)
        if entry is None or entry.removed or entry.decl.generator is None or not entry.decl.generator.tokenizer:
            raise OpenAiError(f"The model `{name}` does not exist or is not a generator with a tokenizer "
                              "(docs/OPENAI.md)", "model", 404, "invalid_request_error", "model_not_found")
        key = (name, id(entry.decl))
        s = self._served.get(key)
        if s is None:
            decl = entry.decl
            s = Served(decl, tokenizer_class(decl.generator.tokenizer)(),
                       ChatTemplate(decl.options.get("chat_template"), name))
            self._served = {k: v for k, v in self._served.items() if k[0] != name}
            self._served[key] = s
        return s

    def model_doc(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "tgw"}

    async def list_models(self, request: web.Request) -> web.Response:
        return await self.answer(request, self._list)

    async def _list(self, request: web.Request):
        return {"object": "list", "data": [self.model_doc(n) for n in self.names()]}

    async def get_model(self, request: web.Request) -> web.Response:
        async def one(request):
            name = request.match_info["model"]
            self.served(name)
            return self.model_doc(name)
        return await self.answer(request, one)

    # ---- every request -----------------------------------------------------------------------

    async def answer(self, request: web.Request, handler) -> web.StreamResponse:
        """`handler(request)`'s JSON document or stream, behind the token; refusals in OpenAI's shape."""
        try:
            if self.port.token:
                given = request.headers.get("Authorization", "")
                if not (given.startswith("Bearer ") and
                        hmac.compare_digest(given[7:].strip().encode(), self.port.token.encode())):
                    raise OpenAiError("Incorrect API key provided: send the broker's token as the API key "
                                      "(Authorization: Bearer TOKEN)", None, 401, "authentication_error",
                                      "invalid_api_key")
            doc = await handler(request)
            resp = doc if isinstance(doc, web.StreamResponse) else \
                web.Response(body=orjson.dumps(doc), content_type="application/json")
        except OpenAiError as err:
            resp = err.response()
        except TgwError as err:
            resp = from_tgw(err).response()
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as exc:   # a broker bug: answered, logged with its stack, serving goes on
            self.port.note("broker_error", type(exc).__name__, f"OpenAI {request.method} {request.path} failed "
                           "inside the broker", exc_info=True)
            resp = OpenAiError(f"broker error: {type(exc).__name__}: {exc}", None, 500, "server_error").response()
        load = self.port.load
        if load is not None and not resp.prepared:   # as every HTTP answer: the load report, the drain notice
            resp.headers[LOAD_HEADER] = load.header
            if load.draining:
                resp.force_close()
        return resp

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.answer(request, lambda r: self.generate(r, chat=False))

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self.answer(request, lambda r: self.generate(r, chat=True))

    async def generate(self, request: web.Request, chat: bool):
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            raise invalid(f"the body is not JSON: {exc}", None) from None
        model = translate.model_of(body)
        served = self.served(model)
        try:
            if chat:
                prompt = served.template.render(messages_of(body.get("messages")))
                plan = translate.chat_plan(body, served.tokenizer, prompt)
            else:
                plan = translate.completion_plan(body, served.tokenizer)
            self.capped(plan, served.decl.generator.max_outputs)
        except OpenAiError:
            self.port.count_error(model, Code.INVALID_ARGUMENT.value)
            raise
        if self.inflight >= self.max_inflight:
            self.port.count_error(model, Code.OVERLOADED.value)
            raise OpenAiError(f"{self.inflight} OpenAI requests in flight (http.max_inflight)", None, 429,
                              "rate_limit_error", "rate_limit_exceeded")
        self.inflight += 1
        callers: list[StreamCaller] = []
        reason = "answered"   # a choice failed: the others are not wanted
        try:
            self.start(request, plan, served, callers)
            return await (self.stream(request, plan, served, callers) if plan.stream
                          else self.whole(plan, served, callers))
        except (asyncio.CancelledError, ConnectionResetError):
            reason = "disconnected"
            raise
        finally:
            self.inflight -= 1
            for c in callers:
                if not c.done:
                    self.port.withdraw(c, reason)

    @staticmethod
    def capped(plan: translate.Plan, cap: int) -> None:
        """The model's cap on outputs (generator.max_outputs) in OpenAI's words: a limit asked
        above it refused naming the parameter; OpenAI's default of 16 lowered to it."""
        for p in plan.params:
            if p.max_outputs is not None and p.max_outputs > cap:
                if not plan.limit_given:
                    p.max_outputs = cap
                    continue
                raise invalid(f"'{plan.limit_given}' is {p.max_outputs}: model {plan.model!r} generates at most "
                              f"{cap} tokens a choice", plan.limit_given)

    def start(self, request: web.Request, plan: translate.Plan, served: Served, callers: list) -> None:
        """Each choice's generation sent through the door (its caller put in `callers`)."""
        loop, h = asyncio.get_running_loop(), request.headers
        decl, port = served.decl, self.port
        for i, params in enumerate(plan.params):
            ids = np.asarray(plan.prompt_of(i), dtype=served.input.dtype)
            msg = Infer(v=PROTOCOL_VERSION, id=next(self.ids), model=plan.model,
                        inputs=[TensorMeta(name=served.input.name, dtype=served.input.dtype, shape=[1, ids.size])],
                        priority=plan.priority, tenant=h.get(TENANT_HEADER), routing_key=h.get(ROUTING_HEADER),
                        traceparent=h.get(TRACEPARENT), generate=params)
            caller = StreamCaller(loop, decl.generator.max_unread_outputs,
                                  on_overflow=lambda c: port.withdraw(c, "slow_reader"))
            callers.append(caller)
            port.infer(caller, msg, [SliceFrame(memoryview(ids).cast("B"))])

    # ---- answers -----------------------------------------------------------------------------

    async def choice_events(self, callers: list[StreamCaller], served: Served, plan: translate.Plan):
        """(index, text piece, finish_reason or None, tokens so far) as the choices' outputs come,
        interleaved; a failed generation raised as its TgwError."""
        texts = [TextStream(served.tokenizer, plan.stops) for _ in callers]
        tokens = [0] * len(callers)

        async def read(i: int):
            caller, text = callers[i], texts[i]
            while True:
                msg, frames = await caller.next()
                if type(msg) is GenerateOutputs:
                    tokens[i] += msg.count
                    piece = text.feed(token_ids(msg, frames, served.output))
                    if text.stopped:   # a stop string: the text ends before it, the generation here
                        if not caller.done:
                            self.port.withdraw(caller, "stop_string")
                        yield i, piece, "stop", tokens[i]
                        return
                    yield i, piece, None, tokens[i]
                else:   # GenerateEnd (its reason), or a plain reply from a generator's stage
                    yield i, text.finish(), translate.finish_reason(getattr(msg, "reason", "done")), tokens[i]
                    return

        if len(callers) == 1:
            async for event in read(0):
                yield event
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int):
            try:
                async for event in read(i):
                    queue.put_nowait(event)
            except BaseException as exc:   # noqa: BLE001 - handed to the reader, who raises it
                queue.put_nowait(exc)
        tasks = [asyncio.ensure_future(pump(i)) for i in range(len(callers))]
        try:
            open_ = len(callers)
            while open_:
                event = await queue.get()
                if isinstance(event, BaseException):
                    raise event
                if event[2] is not None:
                    open_ -= 1
                yield event
        finally:
            for t in tasks:
                t.cancel()

    async def whole(self, plan: translate.Plan, served: Served, callers: list[StreamCaller]) -> dict:
        texts, finishes, used = [""] * len(callers), [None] * len(callers), [0] * len(callers)
        async for i, piece, finish, tokens in self.choice_events(callers, served, plan):
            texts[i] += piece
            used[i] = tokens
            if finish is not None:
                finishes[i] = finish
        choices = [translate.choice(plan, i, texts[i], finishes[i]) for i in range(len(callers))]
        return translate.whole(plan, int(time.time()), choices, sum(used))

    async def stream(self, request: web.Request, plan: translate.Plan, served: Served,
                     callers: list[StreamCaller]) -> web.StreamResponse:
        events = self.choice_events(callers, served, plan)
        try:   # a refusal (admission, a bad parameter the door found) is an HTTP status, not an event
            first = await events.__anext__()
        except StopAsyncIteration:
            first = None
        resp = web.StreamResponse(headers=SSE_HEADERS)
        if self.port.load is not None:
            resp.headers[LOAD_HEADER] = self.port.load.header
        await resp.prepare(request)
        created, used = int(time.time()), [0] * len(callers)
        frames = [translate.chunk_frame(plan, created, i) for i in range(len(callers))]
        if plan.chat:   # OpenAI opens each choice with the assistant's role
            await resp.write(b"".join(_sse(translate.chunk(plan, created, i, "", None, first=True))
                                      for i in range(len(callers))))
        try:
            pending = [first] if first is not None else []
            while True:
                for i, piece, finish, tokens in pending:
                    used[i] = tokens
                    out = []
                    if piece:
                        head, tail = frames[i]
                        out.append(head + orjson.dumps(piece) + tail)
                    if finish is not None:
                        out.append(_sse(translate.chunk(plan, created, i, None, finish)))
                    if out:
                        await resp.write(b"".join(out))
                try:
                    pending = [await events.__anext__()]
                except StopAsyncIteration:
                    break
        except TgwError as err:   # mid-stream: an error event, as OpenAI sends one, then the end
            await resp.write(_sse(from_tgw(err).body()))
            await resp.write_eof()
            return resp
        except (ConnectionResetError, asyncio.CancelledError):   # the client is gone: generate() withdraws
            raise
        except Exception as exc:   # a broker bug after the headers went: said in the stream, logged
            self.port.note("broker_error", type(exc).__name__, f"OpenAI stream {request.path} failed inside the "
                           "broker", exc_info=True)
            await resp.write(_sse(OpenAiError(f"broker error: {type(exc).__name__}: {exc}", None, 500,
                                              "server_error").body()))
            await resp.write_eof()
            return resp
        if plan.include_usage:
            await resp.write(_sse(translate.usage_chunk(plan, created, sum(used))))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def token_ids(msg: GenerateOutputs, frames: list, output: str) -> list[int]:
    """The token ids of a GenerateOutputs' output `output` (its one integer per step)."""
    for meta, frame in zip(msg.outputs, frames):
        if meta.name == output:
            return np.frombuffer(frame, dtype=meta.dtype).tolist()
    return output_arrays(msg, frames)[output].reshape(-1).tolist()   # absent: output_arrays says so


def _sse(doc: dict) -> bytes:
    return b"data: " + orjson.dumps(doc) + b"\n\n"
