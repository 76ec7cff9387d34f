"""The HTTP face: KServe v2 / Open Inference Protocol and /metrics, on the broker's own loop.

aiohttp serves it on the uvloop loop that runs the native socket, and an inference request goes
through the same front door: the same admission, queues, batches and answers. In place of a
socket identity the request holds an HttpCaller, whose future the door's answer resolves, so
nothing in the serving core knows which face a request came from. Health, metadata and
repository answers are built from the same state as the native ops (status.py, rollout.py,
operator.py), through broker/protocol/ as the gRPC face's are; the rest of the broker is reached
only through the DoorPort (protocol/door.py). Off unless configured (`http:` or `tgw-broker
start --http-port`).
"""
from __future__ import annotations

import asyncio
import hmac
import logging
from itertools import count

from aiohttp import web

from tgw.shm.errors import Code, TgwError, error_from_body, fail
from tgw.shm.wire import ErrorReply, InferReply

from tgw.broker.config.schema import HttpDecl
from tgw.broker.observe import status
from tgw.broker.observe.devices import missing
from tgw.broker.observe.load import HEADER as LOAD_HEADER
from tgw.broker.protocol import classification, door, kserve, triton_docs, triton_shm
from tgw.broker.protocol.door import DoorPort
from tgw.broker.protocol.errors import TRACEPARENT
from tgw.broker.protocol.repository import EXTENSIONS, Repository

from . import shm_routes
from .generate_routes import GenerateRoutes
from .answers import HttpCaller, error_response, infer_response, json_response
from .repository_routes import RepositoryRoutes
from .job_routes import JobRoutes

log = logging.getLogger("tgw.broker")
TENANT_HEADER = "tgw-tenant"
OPEN_PATHS = ("/v2/health/live", "/v2/health/ready", "/v2/load")   # balancers probe these without the token


class HttpFace:
    def __init__(self, deps: DoorPort, decl: HttpDecl, mounts: list | None = None):
        """`mounts`: (method, path, handler) routes another face serves on this port (the OpenAI
        face's /v1/...), answering and guarding in their own protocol's shape."""
        self.deps, self.decl = deps, decl
        self.mounts = mounts or []
        self.inflight = 0            # inference requests admitted or waiting to be, not yet answered
        self.ids = count(1)
        self.repository = Repository(deps.view, deps.entry, self.ask, decl.host, deps.token, uploads=deps.uploads)
        self.repository_routes = RepositoryRoutes(self.repository, self.body)
        self.shm = deps.shm if decl.allow_client_shm else None   # each face checks its own allow flag
        self.shm_routes = shm_routes.ShmRoutes(self.shm, self.body, deps.token is not None)
        self.generate_routes = GenerateRoutes(deps, self.body, self.repository.named, self.ids, TENANT_HEADER)
        self.runner: web.AppRunner | None = None
        self.address = ""            # http://host:port once listening
        self.job_routes = JobRoutes(deps, self.body, self.decode, TENANT_HEADER)   # polled jobs (docs/JOBS.md)

    def app(self) -> web.Application:
        # each handler wrapped by `guarded` rather than an aiohttp middleware: measured here, a
        # middleware cost ~360 us of CPU per request, the wrapper ~1 us
        app = web.Application(client_max_size=self.decl.max_body_bytes)
        routes = [("POST", "/infer", self.infer), ("PUT", "/infer", self.infer),   # PUT: a raw body (curl -T)
                  ("GET", "", self.model_metadata), ("GET", "/ready", self.model_ready),
                  ("GET", "/config", self.model_config), ("GET", "/declaration", self.model_declaration),
                  ("GET", "/stats", self.model_stats)]
        add = app.router.add_route
        add("GET", "/v2/models/stats", self.guarded(self.all_stats))   # before {model}: "stats" is no model name
        for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):   # inference first
            for method, tail, handler in routes:
                add(method, base + tail, self.guarded(handler))
        for method, path, handler in (("GET", "/v2/health/live", self.live), ("GET", "/v2/health/ready", self.ready),
                                      ("GET", "/v2", self.server_metadata), ("GET", "/metrics", self.metrics),
                                      ("GET", "/v2/load", self.load),
                                      ("POST", "/v2/repository/index", self.repository_routes.index),
                                      ("POST", "/v2/repository/models/{model}/load", self.repository_routes.load),
                                      ("POST", "/v2/repository/models/{model}/unload",
                                       self.repository_routes.unload)):
            add(method, path, self.guarded(handler, open_path=path in OPEN_PATHS))
        for method, path, handler in self.generate_routes.routes():   # Triton's generate extension
            add(method, path, self.guarded(handler))
        for method, path, handler in self.shm_routes.routes():
            add(method, path, self.guarded(handler))
        for method, path, handler in self.job_routes.routes():
            add(method, path, self.guarded(handler))
        for method, path, handler in self.mounts:
            add(method, path, handler)
        add("*", "/{anything:.*}", self.guarded(self.nowhere, open_path=True))
        return app

    async def start(self, unix: str | None = None) -> str:
        """Listen on the configured host and port, or with `unix` on that Unix socket instead (front
        processes serve the port and forward what they do not serve themselves here)."""
        # handler_cancellation: a client that closes its connection cancels its handler, so an
        # inference nobody waits for is withdrawn (infer) - no per-request watcher needed
        self.runner = web.AppRunner(self.app(), access_log=None, handle_signals=False, shutdown_timeout=5.0,
                                    handler_cancellation=True)
        await self.runner.setup()
        site = web.UnixSite(self.runner, unix, backlog=1024) if unix else \
            web.TCPSite(self.runner, self.decl.host, self.decl.port, backlog=1024, reuse_address=True)
        try:
            await site.start()
        except OSError as exc:
            await self.runner.cleanup()
            self.runner = None
            from tgw.broker.config.startup import StartupError
            raise StartupError(f"http face: cannot listen on {unix or f'{self.decl.host}:{self.decl.port}'}: "
                               f"{exc.strerror or exc}") from None
        if unix:
            self.address = f"unix:{unix}"
        else:
            host, port = site._server.sockets[0].getsockname()[:2]
            self.address = f"http://{host}:{port}"
        log.info("HTTP face (KServe v2, /metrics) on %s", self.address)
        return self.address

    async def stop(self) -> None:
        """Stop listening; answered requests finish writing (every admitted one is answered by now)."""
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
        if self.deps.shm is not None:   # the broker stops: its regions go
            self.deps.shm.close()

    # ---- every request -----------------------------------------------------------------------

    def guarded(self, handler, open_path: bool = False):
        """`handler` behind the token (when configured; load balancers probe health without it),
        answering every refusal in one JSON shape; every answer carries the load report's header
        (made once per refresh), and in the drain notice closes its connection (callers reconnect
        elsewhere)."""
        load = self.deps.load

        async def guarded(request: web.Request) -> web.Response:
            try:
                if self.deps.token and not open_path:
                    self.check_token(request.headers.get("Authorization", ""))
                resp = await handler(request)
            except TgwError as err:
                resp = error_response(err)
            except Exception as exc:  # a broker bug: answered, logged with its stack, serving goes on
                self.deps.note("broker_error", type(exc).__name__, f"HTTP {request.method} {request.path} "
                               "failed inside the broker", exc_info=True)
                resp = error_response(fail(Code.INTERNAL, f"broker error: {type(exc).__name__}: {exc}"))
            if load is not None:
                resp.headers[LOAD_HEADER] = load.header
                if load.draining:
                    resp.force_close()
            return resp
        return guarded

    def check_token(self, given: str) -> None:
        token = self.deps.token
        if not (given.startswith("Bearer ") and hmac.compare_digest(given[7:].strip().encode(), token.encode())):
            raise fail(Code.UNAUTHENTICATED, "missing or wrong token: send \"Authorization: Bearer TOKEN\" "
                       "(the broker is configured with server.auth_token_file)")

    async def nowhere(self, request: web.Request) -> web.Response:
        return json_response({"error": f"no such endpoint: {request.method} {request.path} (docs/HTTP.md lists them)",
                              "code": "NOT_FOUND"}, 404)

    async def ask(self, msg, caller: HttpCaller | None = None):
        """Send a message through the front door as a caller would; its answer."""
        return await door.ask(self.deps, msg, caller or HttpCaller(asyncio.get_running_loop()))

    # ---- inference ---------------------------------------------------------------------------

    async def infer(self, request: web.Request, body: bytes | None = None) -> web.Response:
        """`body`: already read (a front process looked into it first), else read here."""
        model = request.match_info["model"]
        if self.inflight >= self.decl.max_inflight:   # bodies being read count: they hold memory
            self.deps.count_error(model, Code.OVERLOADED.value)
            raise fail(Code.OVERLOADED, f"{self.inflight} HTTP requests in flight (http.max_inflight)",
                       reason="http_inflight", limit=self.decl.max_inflight)
        self.inflight += 1
        try:
            try:
                decoded = await self.decode(request, model, body)
            except TgwError as err:   # counted as the native door counts its refusals
                self.deps.count_error(model, err.code.value)
                raise
            caller = HttpCaller(asyncio.get_running_loop())
            self.deps.infer(caller, decoded.infer, decoded.frames, *triton_shm.route(decoded))   # answers refusals
            try:
                reply, frames = await caller.future
            except asyncio.CancelledError:   # the client closed its connection: nobody waits for it
                self.deps.withdraw(caller, "client_closed")
                raise
        finally:
            self.inflight -= 1
        if isinstance(reply, ErrorReply):
            return error_response(error_from_body(reply.error), reply.traceparent)
        return self.infer_response(request, reply, frames, decoded)

    async def body(self, request: web.Request) -> bytes:
        """The whole body, in as few copies as the stream allows: the chunk itself when it came in
        one, else one join (aiohttp's read() copies twice). Too large: refused before it is read,
        when Content-Length says so."""
        limit = self.decl.max_body_bytes
        length = request.content_length
        if length is not None and "Content-Encoding" not in request.headers:   # as sent: one read
            if length > limit:
                raise self.too_large()
            if length == 0:
                return b""
            if request.content.is_eof():   # it all came with the headers (small bodies): no await
                return request.content.read_nowait()
            try:
                return await request.content.readexactly(length)
            except asyncio.IncompleteReadError:
                raise fail(Code.INVALID_ARGUMENT, f"the body ended before its Content-Length ({length})") from None
        chunks, size = [], 0
        while chunk := await request.content.readany():
            size += len(chunk)
            if size > limit:
                raise self.too_large()
            chunks.append(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def too_large(self) -> TgwError:
        return fail(Code.PAYLOAD_TOO_LARGE, f"request body over http.max_body_bytes ({self.decl.max_body_bytes})",
                    limit=self.decl.max_body_bytes)

    async def decode(self, request: web.Request, model: str, body: bytes | None = None) -> kserve.Decoded:
        """The request's Decoded infer (`body`: already read, else read here)."""
        if model not in self.deps.view.pipelines.table:   # a pipeline's steps are checked as they go
            self.deps.entry(model)   # an unknown model is named before anything in the body
        headers = request.headers
        version = request.match_info.get("version")
        if version is not None:
            version = self.repository.named(model, version)[1]
        content_type, length = headers.get("Content-Type"), headers.get(kserve.HEADER_LENGTH)
        body = body if body is not None else await self.body(request)
        if kserve.is_raw(request.method, content_type, length):   # an image as the body, answered in JSON
            plan = self.deps.view.pipelines.table.get(model)   # a batch dim unless max_batch_size 0
            batched = plan.max_batch_size > 0 if plan is not None else self.deps.entry(model).decl.batched
            decoded = kserve.decode_raw(body, content_type, self.inputs_of(model), model, version,
                                        next(self.ids), headers.get(kserve.ROUTING_HEADER), batched)
        else:
            decoded = kserve.decode(body, length, model, version, next(self.ids), self.shm,
                                    headers.get(kserve.ROUTING_HEADER))
        decoded.infer.tenant, decoded.infer.traceparent = headers.get(TENANT_HEADER), headers.get(TRACEPARENT)
        return decoded

    def inputs_of(self, model: str) -> list:
        """The declared inputs of a pipeline or model (MODEL_NOT_FOUND: neither)."""
        plan = self.deps.view.pipelines.table.get(model)
        return plan.inputs if plan is not None else self.deps.entry(model).inputs

    def infer_response(self, request: web.Request, reply: InferReply, frames: list,
                       decoded: kserve.Decoded) -> web.Response:
        reply, frames = classification.answered(self.deps, reply, frames, decoded.classes)   # top-k asked for
        placed = triton_shm.written(self.shm, decoded, reply, frames)   # outputs into their regions
        return infer_response(request, reply, frames, decoded, placed)

    # ---- health and metadata -----------------------------------------------------------------

    async def live(self, request: web.Request) -> web.Response:
        return json_response({"live": True})

    async def ready(self, request: web.Request) -> web.Response:
        health = status.health(self.deps.view)
        doc = {"ready": health.ready, "models": health.models,
               "devices": {d: {k: v[k] for k in ("state", "uuid", "reason", "models_lost")}
                           for d, v in health.devices.items()}, "missing": missing(health.devices)}
        return json_response(doc, 200 if health.ready else 400)

    async def server_metadata(self, request: web.Request) -> web.Response:
        # "triton": what Triton's clients and examples check; the version is tgw's
        return json_response({"name": "triton", "version": status.SERVER_NAME.split("/")[1],
                              "extensions": [*EXTENSIONS, "generate",
                                             *(triton_shm.EXTENSIONS if self.shm is not None else [])]})

    def named(self, request: web.Request) -> tuple[str, str | None]:
        """The path's model and version (a numeric alias turned into the version's name)."""
        return self.repository.named(request.match_info["model"], request.match_info.get("version"))

    async def model_metadata(self, request: web.Request) -> web.Response:
        return json_response(self.repository.kserve_metadata(*self.named(request)))

    async def model_ready(self, request: web.Request) -> web.Response:
        ready = self.repository.ready(*self.named(request))
        return json_response({"ready": ready}, 200 if ready else 400)

    async def model_config(self, request: web.Request) -> web.Response:
        """Triton's model configuration (triton_docs.py)."""
        return json_response(self.repository.triton_config(*self.named(request)))

    async def model_declaration(self, request: web.Request) -> web.Response:
        """The model's (or pipeline's) declaration as the YAML gave it."""
        model, version = self.named(request)
        plan = self.repository.pipeline(model, version)
        decl = plan.decl if plan is not None else self.repository.version_of(model, version)[0].decl
        return json_response(decl.model_dump(mode="json"))

    async def model_stats(self, request: web.Request) -> web.Response:
        return json_response(triton_docs.statistics(self.repository.triton_stats(*self.named(request))))

    async def all_stats(self, request: web.Request) -> web.Response:
        return json_response(triton_docs.statistics(self.repository.all_stats()))

    async def load(self, request: web.Request) -> web.Response:
        """The load report's figures as JSON (the same refresh as this response's header)."""
        return json_response(self.deps.load.doc if self.deps.load else {})

    async def metrics(self, request: web.Request) -> web.Response:
        text, content_type = self.deps.scrape()
        return web.Response(body=text, headers={"Content-Type": content_type})

