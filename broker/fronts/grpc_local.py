"""A front's gRPC listener: ModelInfer and ModelStreamInfer served here, by the gRPC face's own
Inference over the RemotePort; every other method (metadata, repository, health, reflection,
statistics, shared memory) forwarded to the broker's own gRPC face (GrpcForwarder).

The face is built whole (faces/grpc/face.py GrpcFace, with the port), so the token guard, the
load report's trailer, the status codes and the stream's single writer are the face's own. A
request naming Triton's shared-memory regions (their registry is the broker's) is relayed to the
broker's ModelInfer over its Unix socket, with the caller's metadata and what is left of its
deadline; on a stream, that one request is relayed and its answer written in the stream's turn.
A model this process's directory lacks is looked up afresh first.
"""
from __future__ import annotations

import asyncio
import logging

import grpc

from tgw.broker.config.schema import GrpcDecl
from tgw.broker.faces.grpc import decoupled
from tgw.broker.faces.grpc.face import SERVICE, GrpcFace, credentials, listen
from tgw.broker.faces.grpc.infer import Stream
from tgw.broker.faces.grpc.proto import grpc_service_pb2 as pb
from tgw.broker.protocol.errors import CODE_HEADER, TRACEPARENT
from tgw.broker.protocol.kserve import SHM_REGION

from .mirror import Mirror
from .remote_port import RemotePort

log = logging.getLogger("tgw.broker")
INFER = f"/{SERVICE}/ModelInfer"
STREAM = f"/{SERVICE}/ModelStreamInfer"
STOP_GRACE_S = 2.0   # listeners stopped: what is open was answered by now; this is for writing it
DRAIN_GRACE_S = 60.0   # a drain's open calls (a long stream) are cut after this long


def names_regions(req: pb.ModelInferRequest) -> bool:
    return any(SHM_REGION in t.parameters for t in req.inputs) or any(SHM_REGION in t.parameters for t in req.outputs)


class GrpcLocal:
    def __init__(self, port: RemotePort, mirror: Mirror, decl: GrpcDecl, max_request_bytes: int,
                 max_reply_bytes: int, host: str, public_port: int, unix: str):
        from .grpc_proxy import GrpcForwarder, forwarded_metadata
        self.metadata = forwarded_metadata
        self.face = GrpcFace(port.door, decl, max_request_bytes, max_reply_bytes)
        self.mirror, self.decl = mirror, decl
        self.host, self.public_port = host, public_port
        self.target = f"unix:{unix}"
        self.forwarder = GrpcForwarder(self.target, public_port=public_port)
        self.channel: grpc.aio.Channel | None = None   # the relay of single requests (regions named)
        self.requests = 0
        self.relayed = 0
        self.server: grpc.aio.Server | None = None
        self.stopped: asyncio.Future | None = None   # the drain's server.stop, under way

    def local(self) -> dict[str, grpc.RpcMethodHandler]:
        guarded = self.face.guarded
        return {INFER: grpc.unary_unary_rpc_method_handler(
                    guarded(self.unary), request_deserializer=pb.ModelInferRequest.FromString,
                    response_serializer=pb.ModelInferResponse.SerializeToString),
                STREAM: grpc.stream_stream_rpc_method_handler(
                    guarded(self.stream), request_deserializer=pb.ModelInferRequest.FromString,
                    response_serializer=pb.ModelStreamInferResponse.SerializeToString)}

    async def start(self) -> None:
        options = [("grpc.max_receive_message_length", self.face.receive_limit),
                   ("grpc.max_send_message_length", self.face.send_limit),
                   ("grpc.so_reuseport", 1)]   # the fronts share the public port
        server = grpc.aio.server(options=options)
        server.add_generic_rpc_handlers((self.forwarder.handler(self.local()),))
        host = self.host
        target = f"[{host}]:{self.public_port}" if ":" in host else f"{host}:{self.public_port}"
        listen(server, target, credentials(self.decl), "front: grpc")
        await server.start()
        self.server = server

    async def stop_listening(self) -> None:
        """No new calls; those open go on (for at most DRAIN_GRACE_S)."""
        if self.server is not None and self.stopped is None:
            self.stopped = asyncio.ensure_future(self.server.stop(DRAIN_GRACE_S))

    def busy(self) -> int:
        return self.face.inference.inflight

    def forwarded_count(self) -> int:
        return self.relayed + getattr(self.forwarder, "forwarded", 0)

    async def stop(self) -> None:
        """Stop listening; calls still open are given STOP_GRACE_S to finish writing."""
        if self.server is not None:
            await self.server.stop(STOP_GRACE_S)   # a second stop: the shorter grace applies
            if self.stopped is not None:
                await self.stopped
            self.server = None
        await self.forwarder.close()
        if self.channel is not None:
            await self.channel.close()
            self.channel = None

    # ---- the two inference methods -----------------------------------------------------------

    async def unary(self, req: pb.ModelInferRequest, context) -> pb.ModelInferResponse:
        self.requests += 1
        if not self.mirror.known(req.model_name, req.model_version or None):
            await self.mirror.fresh()
        if self.decl.allow_client_shm and names_regions(req):
            return await self.relay_unary(req, context)
        return await self.face.inference.unary(req, context)

    async def stream(self, requests, context) -> None:
        await FrontStream(self, context).run(self.looked_up(requests))

    async def looked_up(self, requests):
        """The stream's requests, each model looked up afresh when this copy lacks it."""
        mirror = self.mirror
        async for req in requests:
            self.requests += 1
            if not mirror.known(req.model_name, req.model_version or None):
                await mirror.fresh()
            yield req

    # ---- relayed to the broker's face --------------------------------------------------------

    def call(self, req: pb.ModelInferRequest, context):
        if self.channel is None:
            self.channel = grpc.aio.insecure_channel(self.target, options=[
                ("grpc.max_receive_message_length", self.face.send_limit),
                ("grpc.max_send_message_length", self.face.receive_limit)])
        self.relayed += 1
        infer = self.channel.unary_unary(INFER, request_serializer=pb.ModelInferRequest.SerializeToString,
                                         response_deserializer=pb.ModelInferResponse.FromString)
        return infer(req, metadata=self.metadata(context, self.public_port), timeout=context.time_remaining())

    async def relay_unary(self, req: pb.ModelInferRequest, context) -> pb.ModelInferResponse:
        call = self.call(req, context)
        try:
            resp = await call
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details(), tuple(exc.trailing_metadata() or ()))
        context.set_trailing_metadata(tuple(await call.trailing_metadata() or ()))
        return resp


class FrontStream(Stream):
    """The face's stream, but a request naming regions is relayed to the broker's face alone."""

    def __init__(self, local: GrpcLocal, context):
        super().__init__(local.face.inference, context)
        self.local = local

    def submit(self, req: pb.ModelInferRequest) -> None:
        if self.local.decl.allow_client_shm and names_regions(req):
            token = object()   # stands in the stream's live set until the broker answers
            self.live.add(token)
            self.inference.inflight += 1
            task = asyncio.get_running_loop().create_task(self.relayed(token, req))
            self.pumps.add(task)   # cancelled with the stream
            task.add_done_callback(self.pumps.discard)
            return
        super().submit(req)

    async def relayed(self, token, req: pb.ModelInferRequest) -> None:
        call = self.local.call(req, self.context)
        try:
            infer = await call
            trailers = dict(await call.trailing_metadata() or ())
            error = None
        except grpc.aio.AioRpcError as exc:
            trailers = dict(exc.trailing_metadata() or ())
            infer = pb.ModelInferResponse(model_name=req.model_name, id=req.id)
            infer.parameters["tgw_code"].string_param = trailers.get(CODE_HEADER, "INTERNAL")
            error = exc.details() or ""
        except Exception as exc:   # a front bug: this request answered, the stream goes on
            self.deps.note("broker_error", type(exc).__name__, "a relayed stream request failed in the front",
                           exc_info=True)
            trailers, error = {}, f"broker error: {type(exc).__name__}: {exc}"
            infer = pb.ModelInferResponse(model_name=req.model_name, id=req.id)
            infer.parameters["tgw_code"].string_param = "INTERNAL"
        if trailers.get(TRACEPARENT):
            infer.parameters[TRACEPARENT].string_param = trailers[TRACEPARENT]
        infer.parameters[decoupled.FINAL].bool_param = True   # as Triton marks every stream response
        resp = pb.ModelStreamInferResponse(infer_response=infer)
        if error is not None:
            resp.error_message = error
        if token in self.live:
            self.out.put_nowait(resp)
            self.finished(token)
