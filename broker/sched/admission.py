"""Admission: the checks a request passes before it may wait in a queue, and the accounting
when it leaves (finished).

In order: the cheap structural checks (limits, declaration, sizes), the circuit breaker of the
version asked for (route to the fallback model, or CIRCUIT_OPEN), the priority level, a
generation's parameters (generate/admit.py: only a generator's requests are generations), a
sequence model's step (sequence/binding.py: its sequence is live, its level the start's), whether
the deadline can be met at all (predicted compute of its own rows), the tenant's quota
(RATE_LIMITED, UNAUTHENTICATED), inflating compressed tensors, the model's response cache (a hit
is never queued: the front door answers it), then a place in the queue: the model's adaptive
concurrency limit and its queue bound shed from the lowest priority first (OVERLOADED). Every
refusal is a TgwError raised here; the caller answers it.
"""
from __future__ import annotations

import time
from typing import Callable, NamedTuple

from msgspec.structs import replace

from tgw.shm.errors import Code, TgwError, fail
from tgw.shm.ring import aligned_total
from tgw.shm.wire import BYTES, Infer, nbytes_of

from tgw.broker.generate.admit import GenerateCheck
from tgw.broker.sequence.binding import Sequences
from tgw.broker.state.pending import Pending, is_shadow, is_step

from .batcher import Batcher
from .breaker import FAILURES, Breakers
from .concurrency import AdaptiveLimit
from .copies import Copies
from .inbound import CheckedFrame, tensor_bytes
from .limits import check_declared
from tgw.broker.config.load import ModelDecl, ServerDecl, WorkersDecl
from tgw.broker.models.registry import Checked, ModelEntry, Registry
from tgw.broker.state.stats import Stats
from .tenants import Tenants
from .traceparent import check_traceparent
from tgw.broker.state.versions import VersionRecord


MEMO_MAX = 1024  # header shapes remembered by _intake


class Intake(NamedTuple):
    """What the shape-fixed checks of a request found (Admission._intake)."""
    checked: Checked
    out_nbytes: list[int] | None   # each declared output's bytes for its rows; None: -1 dims


class Owed:
    """What each caller is owed: its requests admitted and not yet answered, capped at
    server.max_inflight_per_client (OVERLOADED, reason client_inflight, past it). Admission checks
    the cap and counts a request in; its exit (leave) pays it back. A pipeline's run counts once,
    at its entry (pipeline/executor.py), not per step."""

    def __init__(self, max_owed: int):
        self.max_owed = max_owed               # server.max_inflight_per_client
        self.by_caller: dict[bytes, int] = {}  # caller -> requests admitted and not yet answered

    def check(self, ident: bytes) -> None:
        """OVERLOADED when this caller already has max_inflight_per_client requests unanswered."""
        # a front process (broker/fronts/hub.py FrontCaller) is no client: it caps its own callers
        if self.by_caller.get(ident, 0) >= self.max_owed and not getattr(ident, "unbounded", False):
            raise fail(Code.OVERLOADED, f"this caller already has {self.by_caller[ident]} requests in flight "
                       f"(server.max_inflight_per_client)", reason="client_inflight", limit=self.max_owed)

    def owe(self, ident: bytes) -> None:
        owed = self.by_caller
        owed[ident] = owed.get(ident, 0) + 1

    def paid(self, ident: bytes) -> None:
        owed = self.by_caller
        n = owed.get(ident, 0) - 1
        if n > 0:
            owed[ident] = n
        else:
            owed.pop(ident, None)

    def total(self) -> int:
        return sum(self.by_caller.values())


class Admission:
    def __init__(self, server: ServerDecl, arenas: WorkersDecl, models: list[ModelDecl], tenants: Tenants,
                 registry: Registry, batcher: Batcher, stats: Stats, owed: Owed,
                 clock: Callable[[], float] = time.monotonic, unavailable: Callable[[], str] = str,
                 shed: Callable[[Pending, TgwError], None] = lambda p, err: None, workers: int = 1,
                 demand: Callable[[VersionRecord, float], None] = lambda rec, wait_s: None,
                 drained: Callable[[VersionRecord], None] = lambda rec: None, sequences: Sequences | None = None):
        self.registry, self.batcher, self.stats, self.clock = registry, batcher, stats, clock
        self.costs = batcher.costs
        self.owed, self.server = owed, server   # owed: what each caller is owed (its in-flight cap)
        self.unavailable = unavailable  # why no worker may serve now ("" while one may)
        self.shed = shed                # answers a queued request shed to make room for a higher level
        self.demand = demand            # an on-demand version asked for: load it if no worker has it
        self.drained = drained          # a draining version's last admitted request has left
        self.max_request = server.max_request_bytes
        self.arena = arenas.input_bytes  # a request that alone overflows it could never be staged
        self.out_arena = arenas.output_bytes  # nor one whose outputs alone overflow this
        self.tenants = tenants
        self.breakers = Breakers(models, clock())
        # the floor: the batches the workers may hold plus one forming (a smaller limit only starves them)
        self.pipeline = server.max_inflight_batches_per_worker * workers + 1
        self.limits: dict[str, AdaptiveLimit] = {}
        self.open = True
        self.copies = Copies(batcher, self.is_open, drained)   # shadow versions' copies (canary/)
        self.generating = GenerateCheck()   # a generation's checks, and its sequence id
        # a sequence model's checks and bindings (the sequence wing's: the core asks it too)
        self.sequences = sequences if sequences is not None else Sequences(registry.models, clock)
        for m in models:
            self.declare(m)
        # metrics, traces, slow log, ...: each gets the requests of one exit (leave); given once, by
        # the core's assembly (exits_to), when every part with a hook exists
        self.on_finished: tuple[Callable[[list[Pending], str | None, float], None], ...] = ()
        self._memo: dict[tuple, tuple] = {}   # shape fields -> (model entry, Shape, output bytes)
        self._memo_generation = registry.generation

    def exits_to(self, *hooks: Callable[[list[Pending], str | None, float], None]) -> None:
        """Who hears of each request's exit, in order; set once, at assembly."""
        assert not self.on_finished, "exit hooks are registered once, at assembly"
        self.on_finished = hooks

    def is_open(self) -> bool:
        """False once the broker is stopping."""
        return self.open

    def close(self) -> None:
        """The broker is stopping: new requests are refused (a pipeline's steps still run)."""
        self.open = False

    def declare(self, m: ModelDecl) -> None:
        """A model's adaptive limit and breakers (a model declared at run time gets them too)."""
        if m.adaptive_concurrency and m.slo_p99_ms and m.name not in self.limits:
            self.limits[m.name] = AdaptiveLimit(m.slo_p99_ms / 1000, floor=m.max_rows * self.pipeline,
                                                ceiling=m.max_queue, now=self.clock(), levels=m.priority_levels)
        self.breakers.declare(m, [v.version for v in m.versions], self.clock())

    def admit(self, client: bytes, msg: Infer, tensor_frames: list) -> Pending:
        """Queue the request (or raise the TgwError that answers it)."""
        # a pipeline's step (pipeline/run.py): its run was admitted at the pipeline's entry, which
        # counted it against its caller's cap and its tenant, and a draining broker lets it finish
        internal = is_step(client)
        if not self.open and not internal:
            raise fail(Code.MODEL_NOT_READY, "broker is shutting down", reason="shutting_down")
        if not internal:
            self.owed.check(client)
        sizes = [len(f) for f in tensor_frames]
        intake = self._intake(msg, sizes)
        why = self.unavailable()
        if why:
            raise fail(Code.MODEL_NOT_READY, why, reason="crash_loop", model=msg.model)
        now = self.clock()
        if self.breakers.by_key:
            intake = self._route(msg, intake, sizes, now)
        checked = intake.checked
        model = checked.model.decl
        if not 0 <= msg.priority < model.priority_levels:
            raise fail(Code.INVALID_ARGUMENT, f"priority {msg.priority} is out of range: model {model.name!r} "
                       f"has levels 0..{model.priority_levels - 1} (0 is served first)",
                       priority=msg.priority, priority_levels=model.priority_levels)
        # a generator's request is a generation, and only then (docs/GENERATION.md)
        gen = self.generating.check(checked.model, msg, checked.rows) \
            if msg.generate is not None or checked.model.is_generator else None
        ticket = self.sequences.check(checked.model, msg, checked.rows) \
            if msg.sequence is not None or model.sequence_batching is not None else None
        if ticket is not None and ticket.version not in (None, checked.version):
            # a sequence's requests stay on the version it started on, whatever the traffic split says
            self.sequences.on_version(ticket, msg)
            intake = self._intake(replace(msg, version=ticket.version), sizes)
            checked = intake.checked
        timeout_ms = msg.timeout_ms if msg.timeout_ms is not None else model.timeout_ms
        deadline = now + timeout_ms / 1000.0
        record = checked.record
        if record.on_demand:  # loads it if no worker has it (first: a load outweighs any compute);
            self.demand(record, timeout_ms / 1000.0)   # refuses what cannot wait for the load
        # not even a batch of its own could answer in time (the bound spares most requests the prediction)
        if timeout_ms <= self.costs.bound_ms(model.name, checked.rows) and \
                deadline - (predicted := self.costs.predict(model.name, checked.rows)) <= now:
            raise fail(Code.DEADLINE_EXCEEDED, f"cannot be answered within {timeout_ms} ms: a batch of "
                       f"{checked.rows} row(s) of {model.name!r} is predicted to compute for "
                       f"{predicted * 1000:.1f} ms", timeout_ms=timeout_ms, predicted_ms=round(predicted * 1000, 3))
        tenant = self.tenants.resolve(msg.tenant) if self.tenants.in_use and not internal else None
        if tenant is not None:
            self.tenants.admit(tenant, now, self.costs.recent.get(model.name, 0.001))
        counters, limit, cache = self.stats.models[model.name], self.limits.get(model.name), checked.model.cache
        try:
            p = self._pending(client, msg, intake, tensor_frames, deadline, now, tenant)
            p.generate = gen
            if ticket is not None and ticket.priority is not None:   # its level's FIFO is its order
                p.priority = ticket.priority
            if cache is None or not cache.lookup(p, msg, checked.order, now):
                self._enqueue(p, limit, counters)
            elif limit is not None:   # a hit (p.cache_hit, answered by the front door) leaves as every request
                limit.inflight += 1
        except BaseException:
            if tenant is not None:
                self.tenants.unadmit(tenant)
            raise
        if ticket is not None:
            self.sequences.admitted(p, ticket, now)
        if not internal:
            self.owed.owe(client)
        record.admitted()
        counters.requests += 1
        return p

    def _intake(self, msg: Infer, sizes: list[int]) -> "Intake":
        """The checks fixed by the header's shape fields and the frame sizes - limits, declaration,
        arena fit - memoised on exactly those (a steady stream of like requests pays a dict
        lookup), then per request the version: named or picked by the traffic split, and
        whether it may be served now."""
        if self._memo_generation != self.registry.generation:  # models or routing changed
            self._memo.clear()
            self._memo_generation = self.registry.generation
        key = (msg.model, None if msg.outputs is None else tuple(msg.outputs), tuple(sizes),
               *[(t.name, t.dtype, tuple(t.shape), t.compression, t.wire_dtype) for t in msg.inputs])
        hit = self._memo.get(key)
        if hit is not None:
            entry, shape, out_nbytes = hit
            return Intake(Checked(entry, self.registry.route(entry, msg), shape), out_nbytes)
        check_declared(msg, self.server)
        if sum(sizes) > self.max_request:  # compressed frames of incompressible data can outgrow the raw bytes
            raise fail(Code.PAYLOAD_TOO_LARGE, f"request carries {sum(sizes)} bytes of tensors; the limit is "
                       f"{self.max_request} (server.max_request_bytes)", limit=self.max_request)
        entry = self.registry.entry(msg.model)
        rec = self.registry.route(entry, msg)  # a version problem is reported before a shape problem
        shape, out_nbytes = self._memo_miss(key, entry, msg, sizes)
        return Intake(Checked(entry, rec, shape), out_nbytes)

    def _memo_miss(self, key: tuple, entry: ModelEntry, msg: Infer, sizes: list[int]) -> tuple:
        shape = self.registry.check_shapes(entry, msg, sizes)
        # a bytes tensor takes its frame's bytes (an lz4 one: at least; checked again once inflated)
        self._fits_arena([sizes[i] if msg.inputs[i].dtype == BYTES else nbytes_of(msg.inputs[i].dtype,
                          msg.inputs[i].shape) for i in shape.order])
        out_nbytes = entry.output_bytes(shape.rows)  # None: sized only after compute
        out_need = aligned_total(out_nbytes or [])
        if out_need > self.out_arena:  # never computed: its outputs could never be written
            raise fail(Code.OUT_OF_SHM, f"request's outputs need {out_need} bytes of shared memory; a worker's "
                       f"output arena holds {self.out_arena} (workers.output_arena_mb)", model=msg.model,
                       needed=out_need, limit=self.out_arena, arena="output", config_key="workers.output_arena_mb",
                       retryable=False)
        if len(self._memo) >= MEMO_MAX:  # distinct shapes beyond this are rare: start over
            self._memo.clear()
        self._memo[key] = (entry, shape, out_nbytes)
        return shape, out_nbytes

    def _fits_arena(self, nbytes: list[int]) -> None:
        need = aligned_total(nbytes)
        if need > self.arena:
            raise fail(Code.PAYLOAD_TOO_LARGE, f"request needs {need} bytes of shared memory; a worker's input "
                       f"arena holds {self.arena} (workers.input_arena_mb)", limit=self.arena)

    def _route(self, msg: Infer, intake: "Intake", sizes: list[int], now: float) -> "Intake":
        """The version asked for, or its model's fallback while its breaker is open."""
        checked = intake.checked
        breaker = self.breakers.get(msg.model, checked.version)
        if breaker is None or breaker.allow(now):
            return intake
        fallback = self.breakers.fallback.get(msg.model)
        if fallback is not None:
            # the fallback is asked as a copy of the request: the decoded message stays the caller's
            routed = self._intake(replace(msg, model=fallback, version=None), sizes)  # its own rows limit, readiness
            other = self.breakers.get(fallback, routed.checked.version)
            if other is None or other.allow(now):
                self.stats.models[msg.model].fallbacks += 1
                return routed
        raise fail(Code.CIRCUIT_OPEN, f"circuit breaker of {breaker.name} is {breaker.state.value} "
                   f"({breaker.reason})" + (f"; fallback {fallback!r} is open too" if fallback else ""),
                   model=msg.model, version=checked.version,
                   retry_after_ms=max(1, round(breaker.retry_after_s(now) * 1000)))

    def _pending(self, client: bytes, msg: Infer, intake: "Intake", tensor_frames: list, deadline: float,
                 now: float, tenant) -> Pending:
        checked = intake.checked
        shape = checked.shape
        if msg.output_region is not None:
            _no_bytes_into_region(checked.model, shape.outputs)
        tensors = [f.buffer if type(f := tensor_frames[i]) is CheckedFrame else
                   tensor_bytes(msg.inputs[i], f.buffer, self.server) for i in shape.order]
        if checked.model.has_bytes_inputs and any(msg.inputs[i].compression and msg.inputs[i].dtype == BYTES
                                                   for i in shape.order):
            inflated = sum(len(t) for t in tensors)   # a bytes tensor's lz4 frame has no declared size
            if inflated > self.max_request:
                raise fail(Code.PAYLOAD_TOO_LARGE, f"request's tensors inflate to {inflated} bytes; the limit is "
                           f"{self.max_request} (server.max_request_bytes)", limit=self.max_request)
            self._fits_arena([len(t) for t in tensors])
        p = Pending(client=client, req_id=msg.id, model=checked.model.name, version=checked.version,
                    rows=shape.rows, shape_key=shape.shape_key, tensors=tensors, outputs=shape.outputs,
                    deadline=deadline, compress=msg.compress_outputs, out_nbytes=intake.out_nbytes,
                    priority=msg.priority, arrived=now, tenant=tenant, record=checked.record,
                    batched=checked.model.decl.batched)
        if msg.traceparent is not None:   # an invalid one is ignored (W3C: a new trace starts)
            p.trace = check_traceparent(msg.traceparent)
        p.output_region = msg.output_region   # checked by regions.Regions.resolve
        return p

    def _enqueue(self, p: Pending, limit: AdaptiveLimit | None, counters) -> None:
        """Queue `p` within the model's adaptive limit and queue bound, shedding a lower level."""
        if limit is not None and limit.full(p.priority):
            shed = self.batcher.shed_for(p)
            if shed is None:
                counters.shed[p.priority] += 1
                raise fail(Code.OVERLOADED, f"model {p.model!r} is at its adaptive concurrency limit for "
                           f"priority {p.priority} ({limit.inflight} of {int(limit.limit)} requests in the broker, "
                           f"slo_p99_ms {limit.slo * 1000:g}) and none queued has a lower priority",
                           reason="adaptive_limit", limit=int(limit.limit), priority=p.priority)
            self._shed(shed, "adaptive_limit")
        shed = self.batcher.push(p)
        if shed is not None:
            self._shed(shed, "queue_full")
        if limit is not None:
            limit.inflight += 1

    def _shed(self, p: Pending, reason: str) -> None:
        self.stats.models[p.model].shed[p.priority] += 1
        self.shed(p, fail(Code.OVERLOADED, f"shed from the queue of {p.model!r} to make room for a request of "
                          "higher priority", reason=reason, priority=p.priority))

    def finished(self, p: Pending, code: str | None, now: float) -> None:
        """One request leaves (leave)."""
        self.leave([p], code, now)

    def leave(self, ps: list[Pending], code: str | None, now: float) -> None:
        """Requests of one model and version leave alike - a batch's answered requests, or one
        request: answered with outputs (code None) or with error `code`. The one place their exit
        is accounted: their callers paid, their tenants, version, limit and breaker. The model's
        limit, breaker and counters are looked up once for all of them."""
        first = ps[0]
        if is_shadow(first.client):   # copies: a batch of them holds nothing else (shadow.py)
            return self.copies.left(ps, code)
        model, version = first.model, first.version
        paid = self.owed.paid
        for p in ps:
            if not is_step(p.client):   # a step owes nothing (admit)
                paid(p.client)
            if p.tenant is not None:
                p.tenant.inflight -= 1
            record = p.record
            if record is not None and record.left():
                self.drained(record)
        limit = self.limits.get(model)
        if limit is not None:
            limit.inflight -= len(ps)
            if code is None:
                for p in ps:
                    if p.dispatched is not None:   # a cache hit never was: it tells nothing of compute latency
                        limit.record(now - p.arrived, now)
        if self.breakers.by_key:
            breaker = self.breakers.get(model, version)
            if breaker is not None:
                failed = code in FAILURES
                for p in ps:
                    if p.dispatched is not None:
                        breaker.record(failed, now - p.dispatched, now)
        self.stats.left(model, version, ps, code is None, now)
        for hook in self.on_finished:
            hook(ps, code, now)


def _no_bytes_into_region(entry: ModelEntry, outputs: list[str]) -> None:
    """A request that names an output region may not ask for a bytes output: those travel in frames."""
    carried = [t.name for t in entry.outputs if t.dtype == BYTES and t.name in outputs]
    if carried:
        raise fail(Code.INVALID_ARGUMENT, f"outputs {carried} of {entry.name!r} are bytes tensors, which travel "
                   "in frames, never in a shared-memory region: ask only for the other outputs with an "
                   "output_region, or send no output_region", reason="region_bytes_output", outputs=carried)
