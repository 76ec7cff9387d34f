"""ModelInfer and ModelStreamInfer: gRPC requests through the broker's front door.

Each request holds a caller object in place of a socket identity (protocol/door.py): the
door's answer comes back by `caller.deliver(msg, frames)`. A unary call awaits
its caller's future. A stream reads requests as they come and hands each to the door at once,
so the requests of one stream run concurrently (batched with everyone else's); each answer is
queued as it arrives and one writer sends them in turn (a gRPC call takes one write at a time).
An error answers that request only (`error_message`, with its id), never the stream.
A generator's request on a stream is a generation, answered many times (decoupled.py); unary
ModelInfer refuses a generator as Triton refuses a decoupled model.

A call its client cancelled, or past its deadline, withdraws what it still has in flight
(deps.withdraw, reason "grpc_cancelled" or "deadline"), so nothing is computed for nobody.
Everything here runs on the broker's loop (docs/GRPC.md says why that is safe with uvloop).
"""
from __future__ import annotations

import asyncio
from itertools import count

import grpc

from tgw.shm.errors import Code, TgwError, error_from_body, fail
from tgw.shm.wire import ErrorReply

from tgw.broker.protocol import classification, kserve
from tgw.broker.protocol.door import AwaitedCaller
from tgw.broker.protocol import streaming
from tgw.broker.protocol.errors import TRACEPARENT, details, trailers
from tgw.broker.protocol.triton_shm import route

from . import decoupled, tensors
from .proto import grpc_service_pb2 as pb
from .status_codes import abort, add_trailers

TENANT = "tgw-tenant"


class GrpcCaller(AwaitedCaller):
    """One unary request's stand-in for a socket identity (protocol/door.py)."""
    __slots__ = ()
    face = "grpc"
    # grpc.aio hands the loop one call at a time: the door waits for the burst (FrontDoor.infer)
    trickles_in = True


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

    def generator(self, model: str):
        """The model's entry when it is a generator (None: a plain model or a pipeline); an
        unknown model raises MODEL_NOT_FOUND."""
        if model in self.deps.view.pipelines.table:   # a pipeline's steps are checked as they go
            return None
        entry = self.deps.entry(model)
        return entry if entry.is_generator else None

    def decode(self, req: pb.ModelInferRequest, meta: dict, deadline: int | None, entry=None) -> tensors.Decoded:
        """Refused here: the face's max_inflight, an unknown model, a bad tensor (counted as the
        native door counts its refusals). `entry`: the generator the request is a generation of."""
        model = req.model_name
        try:
            if self.inflight >= self.face.decl.max_inflight:
                raise fail(Code.OVERLOADED, f"{self.inflight} gRPC requests in flight (grpc.max_inflight)",
                           reason="grpc_inflight", limit=self.face.decl.max_inflight)
            if entry is None:
                self.generator(model)   # an unknown model is named before its tensors
            version = self.face.repository.named(model, req.model_version)[1] if req.model_version else None
            decoded = tensors.decode(req, next(self.ids), version, self.face.shm, deadline, generate=entry is not None)
            if entry is not None:
                decoupled.check(entry, decoded)
                if decoded.classes:   # a generation's outputs stream back as they come: no top-k of them
                    raise fail(Code.INVALID_ARGUMENT, f"output {next(iter(decoded.classes))!r}: classification is "
                               "not offered for a generator's outputs", reason="classification_generator")
            decoded.infer.routing_key = kserve.routing_key(decoded.infer.routing_key, meta.get(kserve.ROUTING_HEADER),
                                                           f"metadata {kserve.ROUTING_HEADER}")
        except TgwError as err:
            self.deps.count_error(model, err.code.value)
            raise
        decoded.infer.tenant, decoded.infer.traceparent = meta.get(TENANT), meta.get(TRACEPARENT)
        return decoded

    async def unary(self, req: pb.ModelInferRequest, context) -> pb.ModelInferResponse:
        try:
            refused = self.generator(req.model_name) is not None
        except TgwError as err:
            self.deps.count_error(req.model_name, err.code.value)
            raise
        if refused:   # Triton's answer to a decoupled model: several responses need the stream
            err = fail(Code.INVALID_ARGUMENT, decoupled.UNARY_REFUSED, reason="generator_needs_stream")
            self.deps.count_error(req.model_name, err.code.value)
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, decoupled.UNARY_REFUSED,
                                tuple(context.trailing_metadata() or ()) + trailers(err))
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
        reply, frames = classification.answered(self.deps, reply, frames, decoded.classes)
        return tensors.encode(reply, frames, decoded, self.face.shm)

    async def stream(self, requests, context) -> None:
        await Stream(self, context).run(requests)


class OnceCaller:
    """One plain request of a stream, answered once: its answer goes to the stream's queue."""
    __slots__ = ("stream", "decoded")
    trickles_in = True   # a stream's requests are read one at a time (FrontDoor.infer)

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
        # responses to write; a future: set once everything queued before it is written; None: done
        self.out: asyncio.Queue = asyncio.Queue()
        self.live: set = set()                   # requests handed to the door, not answered
        self.pumps: set[asyncio.Task] = set()    # generations' writers (decoupled.pump)
        self.reading = True

    async def run(self, requests) -> None:
        reader = asyncio.ensure_future(self.read(requests))
        try:
            while (item := await self.out.get()) is not None:
                if isinstance(item, asyncio.Future):
                    if not item.done():
                        item.set_result(None)
                else:
                    await self.context.write(item)
            await reader   # its error, if it ended with one
        except BaseException:   # cancelled (client gone, deadline) or the write failed
            reader.cancel()
            reason = gave_up(self.context)
            for caller in list(self.live):
                self.deps.withdraw(caller, reason)
            self.inference.inflight -= len(self.live)
            self.live.clear()
            for task in list(self.pumps):
                task.cancel()
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
            entry = self.inference.generator(req.model_name)
            empty_final = decoupled.wants_empty_final(req) if entry is not None else False
            decoded = self.inference.decode(req, self.meta, deadline_ms(self.context), entry)
        except TgwError as err:
            self.out.put_nowait(refusal(err, req.id, req.model_name))
            return
        if entry is not None:
            self.generate(entry, decoded, empty_final)
            return
        caller = OnceCaller(self, decoded)
        self.live.add(caller)
        self.inference.inflight += 1
        self.deps.infer(caller, decoded.infer, decoded.frames, *route(decoded))   # may answer at once (a refusal)

    def generate(self, entry, decoded: tensors.Decoded, empty_final: bool) -> None:
        loop = asyncio.get_running_loop()
        caller = streaming.StreamCaller(loop, entry.decl.generator.max_unread_outputs, self.overflowed)
        self.live.add(caller)
        self.inference.inflight += 1
        version = decoded.infer.version or entry.default or ""
        task = loop.create_task(decoupled.pump(self, caller, decoded, version, empty_final))
        self.pumps.add(task)
        task.add_done_callback(self.pumps.discard)
        self.deps.infer(caller, decoded.infer, decoded.frames, *route(decoded))   # may answer at once (a refusal)

    def overflowed(self, caller) -> None:
        """A generation this stream's client reads too slowly: its slot is freed (not from
        inside the door's delivery)."""
        asyncio.get_running_loop().call_soon(self.deps.withdraw, caller, "slow_reader")

    def send(self, responses: list) -> None:
        for resp in responses:
            self.out.put_nowait(resp)

    async def sent(self, responses: list) -> None:
        """Queue `responses` and wait until they are written (a generation's pace is its reader's)."""
        self.send(responses)
        written = asyncio.get_running_loop().create_future()
        self.out.put_nowait(written)
        await written

    def finished(self, caller) -> None:
        """A request's last response is queued: the stream ends after the last request's."""
        if caller not in self.live:   # withdrawn: the stream is gone
            return
        self.live.discard(caller)
        self.inference.inflight -= 1
        if not self.reading and not self.live:
            self.out.put_nowait(None)

    def answered(self, caller: OnceCaller, msg, frames: list) -> None:
        if caller not in self.live:   # withdrawn: the stream is gone
            return
        decoded = caller.decoded
        try:
            if isinstance(msg, ErrorReply):
                resp = refusal(error_from_body(msg.error), decoded.request_id, decoded.infer.model, msg.traceparent)
            else:
                msg, frames = classification.answered(self.deps, msg, frames, decoded.classes)
                infer = tensors.encode(msg, frames, decoded, self.shm)
                if msg.traceparent:
                    infer.parameters[TRACEPARENT].string_param = msg.traceparent
                infer.parameters[decoupled.FINAL].bool_param = True   # as Triton marks every stream response
                resp = pb.ModelStreamInferResponse(infer_response=infer)
        except TgwError as err:
            resp = refusal(err, decoded.request_id, decoded.infer.model)
        except Exception as exc:  # a broker bug: this request answered, the stream goes on
            self.deps.note("broker_error", type(exc).__name__, "gRPC stream answer failed inside the broker",
                           exc_info=True)
            resp = refusal(fail(Code.INTERNAL, f"broker error: {type(exc).__name__}: {exc}"), decoded.request_id,
                           decoded.infer.model)
        self.out.put_nowait(resp)
        self.finished(caller)


def refusal(err: TgwError, request_id: str, model: str, trace: str | None = None) -> pb.ModelStreamInferResponse:
    """One stream request's error: the message ("[CODE] message") and the request's id."""
    infer = pb.ModelInferResponse(model_name=model, id=request_id)
    infer.parameters["tgw_code"].string_param = err.code.value
    infer.parameters[decoupled.FINAL].bool_param = True
    if trace:
        infer.parameters[TRACEPARENT].string_param = trace
    return pb.ModelStreamInferResponse(error_message=details(err), infer_response=infer)

