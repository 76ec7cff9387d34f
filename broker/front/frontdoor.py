"""The clients' side of the broker: read each message once, refuse or route it, and answer.

A header that does not decode still gets a well-formed reply: its id and protocol version are
read leniently where possible, so a newer client learns of the version mismatch rather than of
a "malformed" header. Every refusal is counted (stats `refused`) and logged at most once per
kind in a while; replies go through the outbox (outbound.py), which bounds what a slow reader may hold.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from tgw.shm.errors import Code, TgwError, fail
from tgw.shm.wire import CONTROL_OPS, PROTOCOL_VERSION, Cancel, DecodeError, ErrorReply, Goodbye, Infer, InferReply, \
    JobCancel, JobQuery, Metadata, RegisterRegion, Snapshot, SUPPORTED_VERSIONS, UnregisterRegion, encode, envelope_decoder, \
    request_decoder

from tgw.broker.config.schema import ServerDecl
from tgw.broker.state.complaints import Complaints
from tgw.broker.state.pending import Pending, is_shadow, is_step
from tgw.broker.state.stats import Stats

from . import cuda_route
from .abandon import Abandonment
from .auth import token_ok
from .callers import EVENTS, Callers
from .gatekeeper import Gatekeeper
from .outbound import Outbox, reply_tensors
from .regions import Regions
from .sockets import Pump

NOTEWORTHY = (Code.INVALID_ARGUMENT, Code.PAYLOAD_TOO_LARGE)  # refusals that suggest a broken or hostile caller
OPERATOR_OPS = (*CONTROL_OPS, Metadata)   # answered by operator.py


class Refused(Exception):
    """The message cannot be served; `error` answers it under `req_id`; `kind` counts it."""

    def __init__(self, req_id: int, error: TgwError, kind: str):
        super().__init__(error.message)
        self.req_id, self.error, self.kind = req_id, error, kind


def read_request(frames: list, server: ServerDecl, token: str | None = None):
    """The decoded header of [identity, header, tensor frames...]; raises Refused.

    Sizes are checked before decoding, so a header cannot make the decoder allocate much; the
    token (when one is configured) before anything else is looked at."""
    if len(frames) < 2:
        raise Refused(0, fail(Code.INVALID_ARGUMENT, "empty message: a header frame is required"), "empty_message")
    header = frames[1].buffer
    if len(header) > server.max_header_bytes:
        raise Refused(0, fail(Code.PAYLOAD_TOO_LARGE, f"header frame of {len(header)} bytes; the limit is "
                              f"{server.max_header_bytes} (server.max_header_bytes)",
                              limit=server.max_header_bytes), "header_too_large")
    if len(frames) - 2 > server.max_tensors_per_request:
        raise Refused(0, fail(Code.INVALID_ARGUMENT, f"{len(frames) - 2} tensor frames; the limit is "
                              f"{server.max_tensors_per_request} (server.max_tensors_per_request)",
                              limit=server.max_tensors_per_request), "too_many_frames")
    try:
        msg = request_decoder.decode(header)
    except DecodeError as exc:
        raise _malformed(header, exc) from None
    if msg.v not in SUPPORTED_VERSIONS:
        raise Refused(msg.id, _version_mismatch(msg.v), "version_mismatch")
    if not token_ok(token, msg.token):
        raise Refused(msg.id, fail(Code.UNAUTHENTICATED, "missing or wrong token (the broker is configured with "
                                   "server.auth_token_file; clients pass token= or TGW_TOKEN)"), "unauthenticated")
    return msg


def _malformed(header, exc: Exception) -> Refused:
    try:
        env = envelope_decoder.decode(header)
    except DecodeError:
        env = None
    # `type(...) is int`: a bool is an int to isinstance, but not on the wire
    req_id = env.id if env is not None and type(env.id) is int else 0
    if env is not None and type(env.v) is int and env.v not in SUPPORTED_VERSIONS:
        # a newer client's header may not fit our structs: name the real problem
        return Refused(req_id, _version_mismatch(env.v), "version_mismatch")
    return Refused(req_id, fail(Code.INVALID_ARGUMENT, f"malformed request header: {exc}"), "malformed_header")


def _version_mismatch(version: int) -> TgwError:
    return fail(Code.INVALID_ARGUMENT, f"protocol version mismatch: client speaks {version}, broker speaks "
                f"{PROTOCOL_VERSION} (and serves {', '.join(map(str, SUPPORTED_VERSIONS))})", client_protocol=version,
                server_protocol=PROTOCOL_VERSION, supported=list(SUPPORTED_VERSIONS))


class _Taken:
    """The tracker of a reply a face's caller took at once: done, so the generate wing never
    counts it unread (a face whose reader falls behind is ended by its StreamCaller)."""
    done = True


TAKEN = _Taken()


@dataclass(frozen=True)
class DoorRoutes:
    """Where the front door sends what it takes in (the core gives it when it opens the door,
    once every part behind it exists)."""
    roster: list                                 # the workers (CUDA routing: which GPUs have one)
    models: dict                                 # the registry's model entries by name
    admit: Callable[[Any, Infer, list], Pending]  # admission: raises the TgwError that refuses it
    finished: Callable[[Pending, str | None, float], None]  # a request leaves (admission's accounting)
    leave: Callable[[list, str | None, float], None]        # requests of one batch leave alike (the same)
    batcher: Any                                 # its queues: cancelled and abandoned requests leave them
    schedule: Callable[[], None]                 # the pump is due
    flush: Callable[[], None]                    # the end of a drain pass
    query: Callable[[Any], Any]                  # the read-only answers (status, stats, health, ...)
    operate: Callable[[Any, Any], None]          # a control op (operator), answered by it
    snapshot: Callable[[Any, Callable], None]    # a memory snapshot request; raises TgwError
    pipelines: Any                               # pipeline.executor.Pipelines: names in its `table` go to its start
    withdraw: Callable[[Callable], list]         # requests on workers nobody waits for (abandon.py)
    answered: Callable[[list, float], None]      # a batch's answers sent (shadow copies)
    streams: Any = None                          # generate.streams.Streams: running generations (cancel, bye, gone)
    jobs: Any = None                             # jobs.jobs.Jobs: an infer with `job` set, job reads and cancels
    arrived: Callable[[str], None] | None = None  # a trickling caller's request queued: the pump waits for the burst


class FrontDoor:
    """Built first, from the client socket alone, so every part can be handed its answers
    (reply, error, fail); opened last, with the routes to the parts behind it."""

    def __init__(self, loop, sock, server: ServerDecl, token: str | None, clock: Callable[[], float],
                 complaints: Complaints, callers: Callers, stats: Stats, zap=None):
        self.loop, self.sock, self.zap = loop, sock, zap
        # a tracked send (copy=False) is zero-copy however small, so its tracker tells when libzmq
        # is done with it (pyzmq copies below this threshold and reports it done at once); sends
        # with copy=True, the rest, are unaffected
        sock.copy_threshold = 0
        self.server, self.token, self.clock = server, token, clock
        self.complaints, self.callers, self.stats = complaints, callers, stats
        self.regions = Regions(self.server.max_region_bytes, self.reply, self.error, self.complaints.note)
        self.routes: DoorRoutes | None = None   # until open: nothing is read from the socket before
        self.pump: Pump | None = None
        self.outbox: Outbox | None = None
        self.abandon: Abandonment | None = None
        self.jobs = None   # the jobs wing (open gives it)

    def open(self, routes: DoorRoutes) -> None:
        """Start taking requests: every part they reach exists now."""
        self.routes = routes
        self.pipelines = routes.pipelines
        self.pump = Pump(self.loop, self.sock, self.on_message, after=routes.flush)
        self.outbox = Outbox(self.pump, self.server.client_queue_bytes, self.complaints)
        self.gate = Gatekeeper(self.callers, self.sock.get_monitor_socket(EVENTS), self.zap)
        self.gate.start()
        self.abandon = Abandonment(routes.batcher, self.callers, routes.finished, routes.schedule, self.clock,
                                   self.reply, routes.withdraw)
        self.abandon.runs = routes.pipelines   # a cancel or a caller gone stops its pipeline runs too
        self.abandon.streams = routes.streams  # ... and its running generations
        self.handlers = {RegisterRegion: self._region, UnregisterRegion: self._region}
        self.answers = {Cancel: self.abandon.cancel, Goodbye: self.abandon.goodbye, Snapshot: self._snapshot}
        for op in OPERATOR_OPS:
            self.answers[op] = routes.operate
        self.jobs = routes.jobs
        if self.jobs is not None:
            self.answers[JobQuery], self.answers[JobCancel] = self.jobs.query, self.jobs.cancel

    def cancel_step(self, caller, req_id: int) -> None:
        """A pipeline's step request taken out of its queue, unrun (abandon.py)."""
        self.abandon.cancel(caller, Cancel(v=PROTOCOL_VERSION, id=0, ids=[req_id]))

    def drop_caller(self, caller, reason: str) -> int:
        """A face's caller gave up (`reason`): its requests leave, unrun; how many."""
        return self.abandon.drop_caller({caller}, reason)

    # what status reads of the door (the assembly opens it before anything can ask)
    def abandoned(self) -> dict:
        return dict(self.abandon.counts)

    def cancelled(self) -> dict:
        return self.abandon.cancelled_by_model()

    def regions_held(self) -> dict:
        return self.regions.as_dict()

    def admitted(self, caller, req_id: int) -> Pending | None:
        """The caller's request `req_id` while admitted and unanswered (a job's state reads it)."""
        return self.abandon.inflight.get((caller, req_id))

    def on_message(self, frames: list) -> None:
        try:
            self._on_message(frames)
        except Exception as exc:  # a broker bug: answered as INTERNAL where possible, logged rate-limited
            self.complaints.note("broker_error", type(exc).__name__, "a client message failed inside the broker",
                                 exc_info=True)
            self.error(frames[0].bytes, 0, fail(Code.INTERNAL, f"broker error: {type(exc).__name__}: {exc}"))

    def _on_message(self, frames: list) -> None:
        ident = frames[0].bytes
        try:
            if ident not in self.callers.served and len(frames) > 1:
                self.abandon.meet(ident, frames[1])
            self.callers.let_in(ident)
            msg = read_request(frames, self.server, self.token)
        except Refused as refused:
            self.complaints.note("refused", refused.kind, str(refused))
            return self.error(ident, refused.req_id, refused.error)
        except TgwError as err:
            self.complaints.note("refused", err.details.get("reason", err.code.value), err.message)
            return self.error(ident, 0, err)
        if type(msg) is Infer:   # the hot path: no handler lookup; the drain's end pumps (flush)
            return self._infer(ident, msg, frames[2:], frames[1], False)
        handler = self.handlers.get(type(msg))
        if handler is not None:
            handler(ident, msg, frames)
        else:
            self.dispatch(ident, msg)

    def _region(self, ident, msg, frames: list) -> None:
        self.regions.handle(ident, msg, frames[1])

    def dispatch(self, ident, msg) -> None:
        """Answer a decoded request other than infer (`ident`: a socket identity, or the HTTP
        face's HttpCaller)."""
        answer = self.answers.get(type(msg))
        if answer is not None:
            answer(ident, msg)
        else:
            self.reply(ident, self.routes.query(msg))

    def _snapshot(self, ident, msg: Snapshot) -> None:
        try:
            self.routes.snapshot(msg, lambda reply: self.reply(ident, reply))
        except TgwError as err:
            self.error(ident, msg.id, err)

    def infer(self, ident, msg: Infer, tensor_frames: list, header=None) -> None:
        """A face's request (DoorPort.infer; a pipeline's step, a job's run). A caller whose face's
        requests trickle in a loop pass or more apart (`trickles_in`: gRPC's) has the pump wait for
        the burst (routes.arrived, docs/ARCHITECTURE.md#scheduling); the others' come in bursts
        (aiohttp reads every ready connection in one pass), the pump due at once.
        `header`: the header frame (its Peer-Address says who sent it); None from the HTTP face."""
        self._infer(ident, msg, tensor_frames, header,
                    getattr(ident, "trickles_in", False) and self.routes.arrived is not None)

    def infer_drained(self, ident, msg: Infer, tensor_frames: list, header=None) -> None:
        """A request read in a socket's drain whose end pumps (a Pump with after=routes.flush, as
        the native socket's and the fronts socket's): its burst is whole when the drain ends, so
        it is not held as gRPC's is."""
        self._infer(ident, msg, tensor_frames, header, False)

    def _infer(self, ident, msg: Infer, tensor_frames: list, header, face: bool) -> None:
        """`face`: the pump is told by routes.arrived (else routes.schedule, the native drain's)."""
        if msg.job:   # answered at once with its id; the jobs wing sends it back through here as its own caller
            return self._job(ident, msg, tensor_frames, header)
        try:
            cuda = None
            # a pipeline's step (pipeline/run.py) names a model and carries frames the broker holds:
            # no region, CUDA handle or pipeline to look for
            if not is_step(ident):
                if self.regions.named(msg):   # region tensors: their slices stand in for the (empty) frames
                    tensor_frames = self.regions.resolve(msg, header, tensor_frames)
                if self.pipelines is not None and msg.model in self.pipelines.table:
                    return self.pipelines.start(ident, msg, tensor_frames)   # its steps come back through here
                cuda, tensor_frames = cuda_route.inspect(self.routes.roster, self.routes.models, msg, tensor_frames,
                                                         header)  # CUDA tensors by handle
            p = self.routes.admit(ident, msg, tensor_frames)
            if p.cache_hit is not None:   # its model's response cache answers: no queue, no worker
                return self._cached(p)
            cuda_route.bind(self.routes.models, p, cuda)
            self.abandon.track(p)
            if face:
                self.routes.arrived(p.model)
            else:
                self.routes.schedule()
        except TgwError as err:
            if err.code in NOTEWORTHY or err.details.get("reason") == "client_inflight":
                self.complaints.note("refused", err.details.get("reason", err.code.value), err.message)
            self.error(ident, msg.id, err, msg.model)
        except Exception as exc:  # a broker bug must still answer, and must not stop the drain
            self.complaints.note("broker_error", type(exc).__name__, f"request {msg.id} for {msg.model!r} failed "
                                 "inside the broker", exc_info=True)
            self.error(ident, msg.id, fail(Code.INTERNAL, f"broker error: {type(exc).__name__}: {exc}"), msg.model)

    def _job(self, ident, msg: Infer, tensor_frames: list, header) -> None:
        why = None if self.jobs is not None else "this broker runs no jobs"
        if msg.output_region is not None or msg.output_cuda:
            why = "a job's outputs are kept by the broker until fetched: output_region and output_cuda are not for jobs"
        elif self.regions.named(msg) or any(t.cuda is not None for t in msg.inputs):
            why = ("a job's inputs must travel in its message: a region or CUDA tensor could change before the job "
                   "runs")
        if why is not None:
            return self.error(ident, msg.id, fail(Code.INVALID_ARGUMENT, why), msg.model)
        self.jobs.submit(ident, msg, tensor_frames, header)

    def _cached(self, p: Pending) -> None:
        self.answer([(p, p.cache_hit)], self.clock())
        self.stats.models[p.model].replies += 1

    def tick(self) -> None:
        self.outbox.settle_all()
        now = self.clock()
        self.regions.tick(now)
        self.abandon.sweep(now)
        if self.jobs is not None:
            self.jobs.sweep(now)

    # ---- answers -----------------------------------------------------------------------------

    def reply(self, ident, msg, *tensors) -> None:
        # the outbox copies every frame (an HttpCaller its tensors), so ring views may be released after
        if type(ident) is bytes:
            self.outbox.send(ident, [encode(msg), *tensors])
        else:
            ident.deliver(msg, tensors)

    def send_out(self, ident, msg, *frames, track: bool = False) -> tuple[str, object]:
        """A generation's reply: ("", tracker) once queued (with `track`, the tracker tells when
        libzmq is done with it: a slow reader's unread outputs are those it still holds; a tracked
        send costs some 20 us, so the generate wing tracks one reply in several), else why not
        ("full", "gone")."""
        if type(ident) is not bytes:   # a face's caller took it now: it bounds its own unread (StreamCaller)
            ident.deliver(msg, frames)
            return "", TAKEN if track else None
        why, tracker = self.pump.send([ident, encode(msg), *frames], track=track)
        if why:
            self.complaints.note("dropped", "client_queue_messages" if why == "full" else "client_gone",
                                 "a generation's reply was dropped: its caller is gone or not reading")
        return why, tracker

    def error(self, ident: bytes, req_id: int, err: TgwError, model: str | None = None,
              trace: str | None = None) -> None:
        self.stats.error(model, err.code.value)
        self.reply(ident, ErrorReply(v=PROTOCOL_VERSION, id=req_id, error=err.to_body(), traceparent=trace))

    def fail(self, p: Pending, err: TgwError) -> None:
        """Answer an admitted request with an error."""
        self.routes.finished(p, err.code.value, self.clock())
        if is_shadow(p.client):   # a copy: its shadow counts it (finished), nobody is answered
            return
        err.details.setdefault("model", p.model)
        self.error(p.client, p.req_id, err, p.model, p.trace)   # the broker's span by now, as answer's

    def answer(self, answered: list[tuple[Pending, dict]], now: float) -> None:
        """Answer admitted requests of one batch with their rows of the outputs: (request, views
        into the output arena) pairs, accounted as they leave in one pass first."""
        self.routes.leave([p for p, _ in answered], None, now)
        regions, reply = self.regions, self.reply
        for p, views in answered:
            if p.cache_miss is not None:   # computed for a model with a response cache: kept for the next asker
                cache, key, epoch = p.cache_miss
                cache.store(key, epoch, p, views, now)
            client = p.client
            if is_step(client):
                client.outputs(p, views)   # a pipeline's step: its run copies the rows it reads, once
                continue
            placed = regions.write(p, views) if p.output_region is not None else None
            metas, payload = placed if placed is not None else reply_tensors(p, views)
            cuda_route.mark_outputs(p, metas, payload)   # outputs written into the caller's CUDA buffers
            # p.trace: the broker's request span when tracing is on (set by leave), else the caller's own
            reply(client, InferReply(v=PROTOCOL_VERSION, id=p.req_id, model=p.model, version=p.version,
                                     outputs=metas, traceparent=p.trace), *payload)
        self.routes.answered(answered, now)   # while the views are valid: a shadow copies the outputs

    def close(self) -> None:
        if self.pump is None:   # never opened
            self.sock.close(linger=0)
            return
        self.gate.stop()
        self.pump.close()
