"""ModelInfer and ModelStreamInfer: gRPC requests through the broker's front door.

Each request holds a caller object in place of a socket identity (protocol/door.py): the
door's answer comes back by `caller.deliver(msg, frames)`. A unary call awaits
its caller's future. A stream reads requests as they come and hands each to the door at once,
so the requests of one stream run concurrently (batched with everyone else's); each answer is
queued as it arrives and one writer sends them in turn (a gRPC call takes one write at a time).
An error answers that request only (`error_message`, with its id), never the stream.

A call its client cancelled, or past its deadline, withdraws what it still has in flight
(deps.withdraw, reason "grpc_cancelled" or "deadline"), so nothing is computed for nobody.
Everything here runs on the broker's loop (docs/GRPC.md says why that is safe with uvloop).
"""
from __future__ import annotations

import asyncio
from itertools import count

from tgw.shm.errors import Code, TgwError, error_from_body, fail
from tgw.shm.wire import ErrorReply

from tgw.broker.protocol import kserve
from tgw.broker.protocol.door import AwaitedCaller
from tgw.broker.protocol.errors import TRACEPARENT, details
from tgw.broker.protocol.triton_shm import route

from . import tensors
from .proto import grpc_service_pb2 as pb
from .status_codes import abort, add_trailers

TENANT = "tgw-tenant"


class GrpcCaller(AwaitedCaller):
    """One unary request's stand-in for a socket identity (protocol/door.py)."""
    __slots__ = ()
    face = "grpc"


def metadata(context) -> dict:
    return {key: value for key, value in (context.invocation_metadata() or ())}


def deadline_ms(context) -> int | None:
    """What is left of the call's gRPC deadline, in whole milliseconds (at least 1)."""
    left = context.time_remaining()
    return None if left is None else max(1, int(left * 1000))


def gave_up(context) -> str:
    left = context.time_remaining()
    return "deadline" if left is not None and left <= 0 else "grpc_cancelled"


class Inference:
    """The two inference RPCs of one face (`face`: its deps, decl, repository and shm)."""

    def __init__(self, face):
        self.face, self.deps = face, face.deps
        self.inflight = 0      # inference requests decoded and not yet answered, streams' included
        self.ids = count(1)

    def decode(self, req: pb.ModelInferRequest, meta: dict, deadline: int | None) -> tensors.Decoded:
        """Refused here: the face's max_inflight, an unknown model, a bad tensor (counted as the
        native door counts its refusals)."""
        model = req.model_name
        try:
            if self.inflight >= self.face.decl.max_inflight:
                raise fail(Code.OVERLOADED, f"{self.inflight} gRPC requests in flight (grpc.max_inflight)",
                           reason="grpc_inflight", limit=self.face.decl.max_inflight)
            if model not in self.deps.view.pipelines.table:   # a pipeline's steps are checked as they go
                self.deps.entry(model)   # an unknown model is named before its tensors
            version = self.face.repository.named(model, req.model_version)[1] if req.model_version else None
            decoded = tensors.decode(req, next(self.ids), version, self.face.shm, deadline)
            decoded.infer.routing_key = kserve.routing_key(decoded.infer.routing_key, meta.get(kserve.ROUTING_HEADER),
                                                           f"metadata {kserve.ROUTING_HEADER}")
        except TgwError as err:
            self.deps.count_error(model, err.code.value)
            raise
        decoded.infer.tenant, decoded.infer.traceparent = meta.get(TENANT), meta.get(TRACEPARENT)
        return decoded

    async def unary(self, req: pb.ModelInferRequest, context) -> pb.ModelInferResponse:
        decoded = self.decode(req, metadata(context), deadline_ms(context))
        caller = GrpcCaller(asyncio.get_running_loop())
        self.inflight += 1
        try:
            # route: the door's extra argument when a CUDA region is named (triton_shm.py)
            self.deps.infer(caller, decoded.infer, decoded.frames, *route(decoded))   # answers refusals itself
            reply, frames = await caller.future
        except asyncio.CancelledError:   # the client cancelled, or the deadline passed
            self.deps.withdraw(caller, gave_up(context))
            raise
        finally:
            self.inflight -= 1
        if isinstance(reply, ErrorReply):
            await abort(context, error_from_body(reply.error), reply.traceparent)
        if reply.traceparent:
            add_trailers(context, (TRACEPARENT, reply.traceparent))
        return tensors.encode(reply, frames, decoded, self.face.shm)

    async def stream(self, requests, context) -> None:
        await Stream(self, context).run(requests)


class StreamCaller:
    """One request of a stream: its answer goes to the stream's queue."""
    __slots__ = ("stream", "decoded")

    def __init__(self, stream: "Stream", decoded: tensors.Decoded):
        self.stream, self.decoded = stream, decoded

    def deliver(self, msg, frames) -> None:
        self.stream.answered(self, msg, [bytes(f) for f in frames])

    def __repr__(self) -> str:
        return "grpc-stream"


class Stream:
    def __init__(self, inference: Inference, context):
        self.inference, self.context = inference, context
        self.deps, self.shm = inference.deps, inference.face.shm
        self.meta = metadata(context)
        self.out: asyncio.Queue = asyncio.Queue()   # responses to write; None: the stream is done
        self.live: set[StreamCaller] = set()        # requests handed to the door, not answered
        self.reading = True

    async def run(self, requests) -> None:
        reader = asyncio.ensure_future(self.read(requests))
        try:
            while (resp := await self.out.get()) is not None:
                await self.context.write(resp)
            await reader   # its error, if it ended with one
        except BaseException:   # cancelled (client gone, deadline) or the write failed
            reader.cancel()
            reason = gave_up(self.context)
            for caller in list(self.live):
                self.deps.withdraw(caller, reason)
            self.inference.inflight -= len(self.live)
            self.live.clear()
            raise

    async def read(self, requests) -> None:
        try:
            async for req in requests:
                self.submit(req)
        finally:
            self.reading = False
            if not self.live:
                self.out.put_nowait(None)

    def submit(self, req: pb.ModelInferRequest) -> None:
        try:
            decoded = self.inference.decode(req, self.meta, deadline_ms(self.context))
        except TgwError as err:
            self.out.put_nowait(refusal(err, req.id, req.model_name))
            return
        caller = StreamCaller(self, decoded)
        self.live.add(caller)
        self.inference.inflight += 1
        self.deps.infer(caller, decoded.infer, decoded.frames, *route(decoded))   # may answer at once (a refusal)

    def answered(self, caller: StreamCaller, msg, frames: list) -> None:
        if caller not in self.live:   # withdrawn: the stream is gone
            return
        self.live.discard(caller)
        self.inference.inflight -= 1
        decoded = caller.decoded
        try:
            if isinstance(msg, ErrorReply):
                resp = refusal(error_from_body(msg.error), decoded.request_id, decoded.infer.model, msg.traceparent)
            else:
                infer = tensors.encode(msg, frames, decoded, self.shm)
                if msg.traceparent:
                    infer.parameters[TRACEPARENT].string_param = msg.traceparent
                resp = pb.ModelStreamInferResponse(infer_response=infer)
        except TgwError as err:
            resp = refusal(err, decoded.request_id, decoded.infer.model)
        except Exception as exc:  # a broker bug: this request answered, the stream goes on
            self.deps.note("broker_error", type(exc).__name__, "gRPC stream answer failed inside the broker",
                           exc_info=True)
            resp = refusal(fail(Code.INTERNAL, f"broker error: {type(exc).__name__}: {exc}"), decoded.request_id,
                           decoded.infer.model)
        self.out.put_nowait(resp)
        if not self.reading and not self.live:
            self.out.put_nowait(None)


def refusal(err: TgwError, request_id: str, model: str, trace: str | None = None) -> pb.ModelStreamInferResponse:
    """One stream request's error: the message ("[CODE] message") and the request's id."""
    infer = pb.ModelInferResponse(model_name=model, id=request_id)
    infer.parameters["tgw_code"].string_param = err.code.value
    if trace:
        infer.parameters[TRACEPARENT].string_param = trace
    return pb.ModelStreamInferResponse(error_message=details(err), infer_response=infer)

