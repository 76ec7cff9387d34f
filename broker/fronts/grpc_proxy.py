"""What a front forwards of gRPC: every method it does not serve itself, to the broker's own gRPC
face on its private Unix socket, as raw bytes.

The front's server takes the methods the front serves (`local`) and, for every other method tgw
serves (GRPCInferenceService, grpc.health.v1, server reflection: the table is built from their
protobuf descriptors, so a method's cardinality is never guessed), a raw-bytes handler that calls
the same method over one channel to the broker: the invocation metadata (less gRPC's own and
pseudo headers), the deadline's remaining time, each request message as it comes and each answer
as it comes (nothing buffered beyond a message), the answer's initial and trailing metadata, and
an error's status code, details and trailers. A caller that cancels cancels the forwarded call; a
forwarded call the broker cancels or fails ends the caller's with the same status. A method no
service declares is left to gRPC (UNIMPLEMENTED). The front's view of its peer travels in the
`tgw-front-peer` metadata ("tcp HOST PORT LOCAL_HOST PUBLIC_PORT", as the HTTP forwarder says it;
a caller's own value is dropped), which the broker's face trusts only on its Unix socket
(protocol/triton_shm.py front_peer_uid).
"""
from __future__ import annotations

from typing import Callable
from urllib.parse import unquote

import grpc
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from tgw.broker.faces.grpc.proto import grpc_service_pb2
from tgw.broker.protocol.triton_shm import FRONT_PEER

PEER_KEY = FRONT_PEER
SKIPPED = ("grpc-", ":")   # gRPC's own metadata (timeout, encodings) and HTTP/2 pseudo headers
SKIPPED_KEYS = frozenset(("user-agent", "te", "content-type", PEER_KEY))


def service_methods(*files) -> dict[str, tuple[bool, bool]]:
    """Full method name ("/pkg.Service/Method") -> (client_streaming, server_streaming), for
    every method of every service in the protobuf file descriptors `files`."""
    out = {}
    for file in files:
        for service in file.services_by_name.values():
            for method in service.methods:
                out[f"/{service.full_name}/{method.name}"] = (method.client_streaming, method.server_streaming)
    return out


def tgw_methods() -> dict[str, tuple[bool, bool]]:
    """Every method the broker's gRPC face serves (broker/faces/grpc/face.py registers them)."""
    return service_methods(grpc_service_pb2.DESCRIPTOR, health_pb2.DESCRIPTOR, reflection_pb2.DESCRIPTOR)


def peer_of(context, public_port: int) -> str:
    """PEER_KEY's value: the caller's address and the front's (gRPC tells no local address: a peer
    on this host connects from the host it connects to, the public port's)."""
    kind, _, rest = unquote(context.peer() or "").partition(":")
    host, _, port = rest.rpartition(":")
    host = host.strip("[]")
    if kind in ("ipv4", "ipv6") and port.isdigit() and host and public_port:
        return f"tcp {host} {port} {host} {public_port}"
    return "none"


def forwarded_metadata(context, public_port: int) -> list[tuple[str, str | bytes]]:
    md = [(k, v) for k, v in (context.invocation_metadata() or ())
          if k not in SKIPPED_KEYS and not k.startswith(SKIPPED)]
    md.append((PEER_KEY, peer_of(context, public_port)))
    return md


class _Handler(grpc.GenericRpcHandler):
    def __init__(self, local: dict[str, grpc.RpcMethodHandler], forwarded: dict[str, grpc.RpcMethodHandler]):
        self.table = {**forwarded, **local}

    def service(self, handler_call_details):
        return self.table.get(handler_call_details.method)


class GrpcForwarder:
    def __init__(self, target: str, methods: dict[str, tuple[bool, bool]] | None = None,
                 max_message_bytes: int = -1, public_port: int = 0):
        """`target`: the broker's own gRPC face ("unix:/path"); `methods`: what may be forwarded,
        full name -> (client_streaming, server_streaming) (default: every method tgw serves);
        `max_message_bytes`: the channel's limit both ways (-1: none, the broker's face and the
        front's server enforce theirs); `public_port`: the port the front serves (0: the peer is
        not told, so the broker cannot learn a caller's uid: shared memory registration then
        needs the token)."""
        self.target, self.public_port = target, public_port
        self.methods = tgw_methods() if methods is None else dict(methods)
        self.options = [("grpc.max_receive_message_length", max_message_bytes),
                        ("grpc.max_send_message_length", max_message_bytes)]
        self.channel: grpc.aio.Channel | None = None   # made on first use, on the serving loop
        self.callables: dict[str, Callable] = {}
        self.forwarded = 0           # calls forwarded in this life

    def handler(self, local: dict[str, grpc.RpcMethodHandler]) -> grpc.GenericRpcHandler:
        """Serves `local` (full method name -> handler) itself and forwards every other method."""
        forwarded = {}
        for name, (client_streaming, server_streaming) in self.methods.items():
            if name in local:
                continue
            if client_streaming and server_streaming:
                make, call = grpc.stream_stream_rpc_method_handler, self.stream_stream
            elif client_streaming:
                make, call = grpc.stream_unary_rpc_method_handler, self.stream_unary
            elif server_streaming:
                make, call = grpc.unary_stream_rpc_method_handler, self.unary_stream
            else:
                make, call = grpc.unary_unary_rpc_method_handler, self.unary_unary
            forwarded[name] = make(self.bound(call, name))
        return _Handler(dict(local), forwarded)

    @staticmethod
    def bound(call, name: str):
        async def handle(request, context):
            return await call(name, request, context)
        return handle

    def multicallable(self, name: str) -> Callable:
        found = self.callables.get(name)
        if found is None:
            if self.channel is None:
                self.channel = grpc.aio.insecure_channel(self.target, options=self.options)
            client_streaming, server_streaming = self.methods[name]
            kind = {(False, False): self.channel.unary_unary, (False, True): self.channel.unary_stream,
                    (True, False): self.channel.stream_unary, (True, True): self.channel.stream_stream}
            found = self.callables[name] = kind[(client_streaming, server_streaming)](name)
        return found

    def start(self, name: str, request, context):
        self.forwarded += 1
        return self.multicallable(name)(request, metadata=forwarded_metadata(context, self.public_port),
                                        timeout=context.time_remaining())

    # ---- the four cardinalities --------------------------------------------------------------

    async def unary_unary(self, name: str, request: bytes, context) -> bytes:
        return await self.single(self.start(name, request, context), context)

    async def stream_unary(self, name: str, requests, context) -> bytes:
        return await self.single(self.start(name, requests, context), context)

    async def unary_stream(self, name: str, request: bytes, context) -> None:
        await self.streamed(self.start(name, request, context), context)

    async def stream_stream(self, name: str, requests, context) -> None:
        await self.streamed(self.start(name, requests, context), context)

    async def single(self, call, context) -> bytes:
        try:
            answer = await call
            await self.copy_initial(call, context)
        except grpc.aio.AioRpcError as err:
            await self.failed(err, context)
        finally:
            if not call.done():   # the caller went: so does the forwarded call
                call.cancel()
        context.set_trailing_metadata(await call.trailing_metadata())
        return answer

    async def streamed(self, call, context) -> None:
        try:
            await self.copy_initial(call, context)
            async for answer in call:
                await context.write(answer)
        except grpc.aio.AioRpcError as err:
            await self.failed(err, context)
        finally:
            if not call.done():
                call.cancel()
        context.set_trailing_metadata(await call.trailing_metadata())

    @staticmethod
    async def copy_initial(call, context) -> None:
        initial = await call.initial_metadata()
        if initial:
            await context.send_initial_metadata(tuple(initial))

    @staticmethod
    async def failed(err: grpc.aio.AioRpcError, context) -> None:
        """End the caller's call as the broker ended the forwarded one."""
        initial = err.initial_metadata()
        if initial:
            try:
                await context.send_initial_metadata(tuple(initial))
            except Exception:  # already sent (a stream's first answers went): the trailers still go
                pass
        await context.abort(err.code(), err.details() or "", tuple(err.trailing_metadata() or ()))

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()
            self.channel = None
            self.callables.clear()
