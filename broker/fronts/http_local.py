"""A front's HTTP listener: the inference routes served here, by the HTTP face's own code over
the RemotePort, and every other path forwarded to the broker's own HTTP face (HttpForwarder).

The inference routes are the HttpFace's (`/v2/models/{model}/infer` and its versions form, POST
and PUT), behind its token guard, body limits, headers and error shapes: the handler is the
face's `infer`, so nothing about a request's meaning is written twice. What this process cannot
answer goes to the broker whole: a request naming Triton's shared-memory regions (their
registry is the broker's), its body handed over as read. A model this process's directory
lacks is looked up afresh first (it may have been loaded a moment ago).

Listening on the public port with SO_REUSEPORT: the kernel spreads connections over the fronts.
"""
from __future__ import annotations

import logging

from aiohttp import web

from tgw.shm.errors import TgwError

from tgw.broker.config.schema import HttpDecl
from tgw.broker.config.startup import StartupError
from tgw.broker.faces.http.face import HttpFace
from tgw.broker.protocol import kserve

from .mirror import Mirror
from .remote_port import RemotePort

log = logging.getLogger("tgw.broker")
INFER_ROUTES = tuple((method, base + "/infer") for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}")
                     for method in ("POST", "PUT"))
SHM_MARK = kserve.SHM_REGION.encode()


class HttpLocal:
    def __init__(self, port: RemotePort, mirror: Mirror, decl: HttpDecl, host: str, public_port: int, unix: str):
        from .http_proxy import HttpForwarder
        self.face = HttpFace(port.door, decl)
        self.mirror, self.decl = mirror, decl
        self.host, self.public_port = host, public_port
        self.forwarder = HttpForwarder(unix)
        self.requests = 0       # inference requests taken here
        self.forwarded = 0      # requests (any path) forwarded to the broker's face
        self.open = 0           # ... of which not answered yet
        self.runner: web.AppRunner | None = None
        self.site: web.TCPSite | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.decl.max_body_bytes)
        infer = self.face.guarded(self.infer)
        for method, path in INFER_ROUTES:
            app.router.add_route(method, path, infer)
        app.router.add_route("*", "/{anything:.*}", self.forward)
        return app

    async def start(self) -> None:
        self.runner = web.AppRunner(self.app(), access_log=None, handle_signals=False, shutdown_timeout=5.0,
                                    handler_cancellation=True)
        await self.runner.setup()
        self.site = web.TCPSite(self.runner, self.host, self.public_port, backlog=1024, reuse_address=True,
                                reuse_port=True)
        try:
            await self.site.start()
        except OSError as exc:
            await self.runner.cleanup()
            self.runner = None
            raise StartupError(f"front: http: cannot listen on {self.host}:{self.public_port}: "
                               f"{exc.strerror or exc}") from None

    async def stop_listening(self) -> None:
        if self.site is not None:
            await self.site.stop()
            self.site = None

    async def stop(self) -> None:
        """Connections closed (every request answered by now), the forwarder's too."""
        await self.stop_listening()
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
        await self.forwarder.close()

    async def forward(self, request: web.Request, body: bytes | None = None) -> web.StreamResponse:
        self.forwarded += 1
        self.open += 1
        try:
            if body is None:
                return await self.forwarder.handle(request)
            return await self.forwarder.handle(request, body=body)
        finally:
            self.open -= 1

    def busy(self) -> int:
        """Requests this listener still works on (a drain waits for them)."""
        return self.face.inflight + self.open

    def forwarded_count(self) -> int:
        return self.forwarded

    async def infer(self, request: web.Request) -> web.StreamResponse:
        """The face's infer (inside its guard); forwarded whole where it needs the broker."""
        self.requests += 1
        info = request.match_info
        model, version = info["model"], info.get("version")
        mirror = self.mirror
        if not mirror.known(model, version):
            await mirror.fresh()   # still unknown: the face refuses it as the registry would
        if not self.decl.allow_client_shm:   # no region can be named: every request is this process's
            return await self.face.infer(request)
        try:
            body = await self.face.body(request)
        except TgwError as err:   # counted as the face counts its refusals
            self.face.deps.count_error(model, err.code.value)
            raise
        length = request.headers.get(kserve.HEADER_LENGTH)
        head = body[:int(length)] if length and length.isdigit() else body
        if SHM_MARK in head:   # the broker holds the regions' registry
            return await self.forward(request, body)
        return await self.face.infer(request, body)
