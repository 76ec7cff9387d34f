"""The KServe v2 gRPC face: inference.GRPCInferenceService (Triton's protocol), grpc.health.v1
and server reflection, on the broker's own loop.

grpc.aio serves it on the uvloop loop that runs the native socket and the HTTP face, and its
requests go through the same front door as theirs (infer.py), through the same DoorPort
(protocol/door.py); its semantics come from broker/protocol/, as the HTTP face's do.
Measured before choosing (docs/GRPC.md has the script and figures): a grpc.aio server on
uvloop, on the main thread, answered 2,000 sequential unary calls (p50 456-563 us, as on
asyncio's own loop: 428-569 us), 4,000 calls at concurrency 64 (about 5,500 calls/s on both
loops) and a stream of 1,000 requests, every one answered, ids matched; so no thread of its own
and no hand-over between loops. One rule it needs: a call takes one write at a time, so a
stream's answers go through one writer (infer.Stream).

Every RPC is built from the service descriptor (grpc_service_pb2), so none is left without an
answer. Off unless configured (`grpc:` or `tgw-broker start --grpc-port`).
"""
from __future__ import annotations

import asyncio
import hmac
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tgw.shm.errors import Code, TgwError, fail

from tgw.broker.config.schema import GrpcDecl
from tgw.broker.observe import status
from tgw.broker.observe.load import HEADER as LOAD_HEADER
from tgw.broker.protocol import door
from tgw.broker.protocol.door import DoorPort
from tgw.broker.protocol.repository import Repository, loopback

from .infer import GrpcCaller, Inference
from .proto import grpc_service_pb2 as pb
from .services import Services
from .status_codes import abort

log = logging.getLogger("tgw.broker")
SERVICE = "inference.GRPCInferenceService"
HEALTH_POLL_S = 0.5        # how often readiness is looked at for grpc.health.v1 (a few dict reads)
MESSAGE_OVERHEAD = 1 << 20   # a message's fields beside its tensor bytes (names, shapes, typed varints)
STOP_GRACE_S = 2.0         # every admitted request is answered before stop: this is for writing them
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def listen(server, target: str, creds, who: str) -> int:
    """Bind `server` to `target` (TLS when `creds`); the port bound, or StartupError saying why
    (the broker's face and each front process bind alike)."""
    from tgw.broker.config.startup import StartupError
    try:
        port = server.add_secure_port(target, creds) if creds else server.add_insecure_port(target)
    except RuntimeError as exc:
        port, why = 0, str(exc)
    else:
        why = "the address is taken or not this host's"
    if not port:
        raise StartupError(f"{who}: cannot listen on {target}: {why}")
    return port


def credentials(decl: GrpcDecl) -> grpc.ServerCredentials | None:
    """TLS from the config's PEM files (None: plaintext); with tls_client_ca_file, callers need
    a certificate it signed."""
    if decl.tls_cert_file is None:
        return None
    from tgw.broker.config.startup import StartupError

    def read(path: str) -> bytes:
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as exc:
            raise StartupError(f"grpc face: cannot read {path}: {exc.strerror}") from None
    ca = read(decl.tls_client_ca_file) if decl.tls_client_ca_file else None
    return grpc.ssl_server_credentials([(read(decl.tls_key_file), read(decl.tls_cert_file))], root_certificates=ca,
                                       require_client_auth=ca is not None)


class Health(health.aio.HealthServicer):
    """The library's servicer (Watch streams each change the poll sets), with Check brought up
    to date first: a probe right after the broker turns ready sees it, not the last poll."""

    def __init__(self, refresh):
        super().__init__()
        self.refresh = refresh

    async def Check(self, request, context):
        await self.refresh()
        return await super().Check(request, context)


class GrpcFace:
    def __init__(self, deps: DoorPort, decl: GrpcDecl, max_request_bytes: int, max_reply_bytes: int):
        """`max_request_bytes`: server.max_request_bytes; `max_reply_bytes`: the largest reply
        (a worker's output arena), the send limit."""
        self.deps, self.decl = deps, decl
        self.receive_limit = max_request_bytes + MESSAGE_OVERHEAD
        self.send_limit = max(max_request_bytes, max_reply_bytes) + MESSAGE_OVERHEAD
        self.shm = deps.shm if decl.allow_client_shm else None   # each face checks its own allow flag
        self.repository = Repository(deps.view, deps.entry, self.ask, decl.host, deps.token, "a gRPC face",
                                     deps.uploads)
        # beyond loopback, control needs a token or callers that TLS identifies (client certificates)
        self.repository.open_to_network = not loopback(decl.host) and not deps.token and not decl.tls_client_ca_file
        self.inference = Inference(self)
        self.services = Services(self)
        self.health = Health(self.show_health)
        self.shown: dict[str, int] = {}   # each health service name's status as last set
        self.server: grpc.aio.Server | None = None
        self.poller: asyncio.Task | None = None
        self.port = 0
        self.address = ""            # host:port once listening

    def handler(self) -> grpc.GenericRpcHandler:
        table = {**self.services.table(), "ModelInfer": self.inference.unary, "ModelStreamInfer": self.inference.stream}
        methods = {}
        for method in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
            request, response = getattr(pb, method.input_type.name), getattr(pb, method.output_type.name)
            make = grpc.stream_stream_rpc_method_handler if method.client_streaming \
                else grpc.unary_unary_rpc_method_handler
            methods[method.name] = make(self.guarded(table[method.name]), request_deserializer=request.FromString,
                                        response_serializer=response.SerializeToString)
        return grpc.method_handlers_generic_handler(SERVICE, methods)

    async def start(self, unix: str | None = None) -> str:
        """Listen on the configured host and port, or with `unix` on that Unix socket instead, plain
        (front processes serve the port, TLS included, and forward what they do not serve here)."""
        options = [("grpc.max_receive_message_length", self.receive_limit),
                   ("grpc.max_send_message_length", self.send_limit),
                   ("grpc.so_reuseport", 0)]   # a port another process holds is refused, not shared
        server = grpc.aio.server(options=options)
        server.add_generic_rpc_handlers((self.handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection([SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
        host = self.decl.host
        target = f"[{host}]:{self.decl.port}" if ":" in host else f"{host}:{self.decl.port}"
        creds = credentials(self.decl) if not unix else None
        target = f"unix:{unix}" if unix else target
        port = listen(server, target, creds, "grpc face")
        await server.start()
        self.server, self.port = server, port
        self.address = f"unix:{unix}" if unix else f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        await self.show_health()
        self.poller = asyncio.ensure_future(self.watch_health())
        log.info("gRPC face (KServe v2, grpc.health.v1, reflection%s) on %s", ", TLS" if creds else "", self.address)
        return self.address

    async def stop(self) -> None:
        """Stop listening; answered requests finish writing (every admitted one is answered by now)."""
        if self.poller is not None:
            self.poller.cancel()
            self.poller = None
        if self.server is not None:
            await self.health.enter_graceful_shutdown()   # watchers see NOT_SERVING
            await self.server.stop(STOP_GRACE_S)
            self.server = None
        if self.shm is not None:   # the broker stops: its regions go (the HTTP face may have, too)
            self.shm.close()

    # ---- every request -----------------------------------------------------------------------

    def guarded(self, handler):
        """`handler` behind the token (when configured; health and reflection are other services,
        open), answering every refusal with its status code; every call's trailing metadata
        carries the load report (endpoint-load-metrics, made once per refresh)."""
        load = self.deps.load

        async def guarded(request, context):
            if load is not None:
                context.set_trailing_metadata(((LOAD_HEADER, load.header),))
            try:
                if self.deps.token:
                    self.check_token(context)
                return await handler(request, context)
            except grpc.aio.AbortError:
                raise
            except TgwError as err:
                await abort(context, err)
            except Exception as exc:  # a broker bug: answered, logged with its stack, serving goes on
                self.deps.note("broker_error", type(exc).__name__, "a gRPC call failed inside the broker",
                               exc_info=True)
                await abort(context, fail(Code.INTERNAL, f"broker error: {type(exc).__name__}: {exc}"))
        return guarded

    def check_token(self, context) -> None:
        given = next((v for k, v in (context.invocation_metadata() or ()) if k == "authorization"), "")
        if not (isinstance(given, str) and given.startswith("Bearer ")
                and hmac.compare_digest(given[7:].strip().encode(), self.deps.token.encode())):
            raise fail(Code.UNAUTHENTICATED, "missing or wrong token: send metadata \"authorization: Bearer TOKEN\" "
                       "(the broker is configured with server.auth_token_file)")

    async def ask(self, msg):
        """Send a message through the front door as a caller would; its answer."""
        return await door.ask(self.deps, msg, GrpcCaller(asyncio.get_running_loop()))

    # ---- grpc.health.v1 ----------------------------------------------------------------------

    async def watch_health(self) -> None:
        """Readiness as grpc.health.v1 shows it, kept current (Watch streams each change)."""
        while True:
            await asyncio.sleep(HEALTH_POLL_S)
            try:
                await self.show_health()
            except Exception:  # a broker bug: logged, the probe keeps its last answer
                self.deps.note("broker_error", "grpc_health", "gRPC health update failed", exc_info=True)

    async def show_health(self) -> None:
        """"" and the service: the broker is ready (status.health); each model and pipeline by
        name: it can be served now."""
        view = self.deps.view
        now = status.health(view)
        want = {"": now.ready, SERVICE: now.ready}
        serving = view.is_serving()
        want.update({name: serving and ok for name, ok in now.models.items()})
        want.update({name: self.repository.ready(name, None) for name in view.pipelines.table})
        for name, ok in want.items():
            shown = SERVING if ok else NOT_SERVING
            if self.shown.get(name) != shown:
                await self.health.set(name, shown)
                self.shown[name] = shown
        for gone in set(self.shown) - set(want):   # unloaded: unknown again
            await self.health.set(gone, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            del self.shown[gone]
