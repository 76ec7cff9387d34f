"""Trace context on the native face, and OpenTelemetry spans per request (observability.tracing).

A request may carry a W3C `traceparent` (docs/PROTOCOL.md 5.2; checked at admission by
sched/traceparent.py); a valid one becomes the
request's `Pending.trace`, travels to the worker in its batch (`Batch.traces`) and comes back
in the reply. An invalid one is ignored, as W3C says (a new trace starts), and counted in a log
line at most once every 10 s.

With tracing configured, each admitted request gets, when it leaves (the Admission.on_finished
hook), a `tgw.request` span - a child of the caller's span when it sent one - with children
`admission`, `queue` (arrived -> handed to a worker), `compute` (its batch's compute as the
worker measured it, ending when the broker took the completion) and `reply` (until the answer
was handed to the socket). They are built afterwards with explicit times: the broker's
time.monotonic clock plus one offset to the epoch. The reply then carries the `tgw.request`
span's own traceparent. Workers get the setting in their WorkerStart (`for_workers`) and add a
`tgw.batch` span per batch, linked to each request's trace context (workers/tracing.py).

Zero cost when off: opentelemetry is imported only by Tracer, made only when tracing is on, and
nothing is hooked.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable

from tgw.broker.state.pending import Pending
from tgw.broker.config.startup import StartupError
from tgw.broker.config.schema import TracingDecl

def resolve(decl: TracingDecl, base_dir: str) -> TracingDecl:
    """The file exporter's path made absolute against `base_dir` (the config file's folder)."""
    if decl.path is None or os.path.isabs(decl.path):
        return decl
    return decl.model_copy(update={"path": os.path.normpath(os.path.join(base_dir, decl.path))})


def exporter(decl: TracingDecl):
    """The span exporter and its processor class for `decl` (imports opentelemetry)."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor
    if decl.exporter == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        return BatchSpanProcessor(OTLPSpanExporter(**({"endpoint": decl.endpoint} if decl.endpoint else {})))
    out = open(decl.path, "a", encoding="utf-8") if decl.exporter == "file" else None  # noqa: SIM115
    return SimpleSpanProcessor(ConsoleSpanExporter(out=out or sys.stdout,
                                                   formatter=lambda span: span.to_json(indent=None) + "\n"))


class Tracer:
    """The broker's spans, built when each request leaves (an Admission.on_finished hook)."""

    def __init__(self, decl: TracingDecl, loop: Any = None, clock: Callable[[], float] = time.monotonic):
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        self.api = trace
        self.provider = TracerProvider(resource=Resource.create({"service.name": decl.service_name,
                                                                 "service.instance.id": f"broker-{os.getpid()}"}),
                                       sampler=ParentBased(TraceIdRatioBased(decl.sample_ratio)))
        self.provider.add_span_processor(exporter(decl))
        self.tracer = self.provider.get_tracer("tgw.broker")
        self.loop, self.clock = loop, clock
        self.offset_ns = time.time_ns() - int(clock() * 1e9)   # the clock's seconds -> epoch ns
        self.replying: list = []   # (reply span, request span): ended once the loop has sent the replies

    def ns(self, t: float) -> int:
        return int(t * 1e9) + self.offset_ns

    def parent(self, traceparent: str | None):
        if traceparent is None:
            return None
        api = self.api
        ctx = api.SpanContext(int(traceparent[3:35], 16), int(traceparent[36:52], 16), is_remote=True,
                              trace_flags=api.TraceFlags(int(traceparent[53:55], 16)))
        return api.set_span_in_context(api.NonRecordingSpan(ctx))

    def __call__(self, ps: list[Pending], code: str | None, now: float) -> None:
        for p in ps:
            self.request_span(p, code, now)

    def request_span(self, p: Pending, code: str | None, now: float) -> None:
        api, ns = self.api, self.ns
        span = self.tracer.start_span(
            "tgw.request", context=self.parent(p.trace), kind=api.SpanKind.SERVER, start_time=ns(p.arrived),
            attributes={"tgw.model": p.model, "tgw.version": p.version, "tgw.request_id": p.req_id,
                        "tgw.rows": p.rows, "tgw.priority": p.priority, "tgw.code": code or "OK"})
        ctx = span.get_span_context()
        p.trace = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"   # the reply's
        if not span.is_recording():   # not sampled: the context travels on, nothing is written
            return
        if code is not None:
            span.set_status(api.Status(api.StatusCode.ERROR, code))
        inner = api.set_span_in_context(span)

        def child(name: str, start: float, end: float | None = None, **attributes):
            s = self.tracer.start_span(name, context=inner, start_time=ns(start), attributes=attributes or None)
            if end is not None:
                s.end(end_time=ns(end))
            return s

        child("admission", p.arrived, p.arrived)
        dispatched = p.dispatched   # None: never handed to a worker (a cache hit, withdrawn)
        child("queue", p.arrived, now if dispatched is None else dispatched,
              **{"tgw.dispatched": dispatched is not None})
        if dispatched is not None and p.compute_us:   # the compute ended before the broker took the completion
            child("compute", max(dispatched, now - p.compute_us / 1e6), now, **{"tgw.compute_us": p.compute_us})
        self.replying.append((child("reply", now), span))
        if self.loop is None:
            self.end_replies()
        elif len(self.replying) == 1:
            self.loop.call_soon(self.end_replies)

    def end_replies(self) -> None:
        """The replies of this loop turn are with the socket now: their spans end."""
        end = self.ns(self.clock())
        for reply, span in self.replying:
            reply.end(end_time=end)
            span.end(end_time=end)
        self.replying.clear()

    def shutdown(self) -> None:
        self.end_replies()
        self.provider.shutdown()


def for_workers(decl: TracingDecl | None, base_dir: str) -> dict | None:
    """The workers' setting (WorkerStart.tracing): the resolved TracingDecl as a dict, None when off."""
    return None if decl is None else resolve(decl, base_dir).model_dump()


def install(decl: TracingDecl | None, loop: Any, base_dir: str) -> Tracer | None:
    """Tracing on: a Tracer, to be hooked on each request's end (the workers learn it from for_workers)."""
    if decl is None:
        return None
    decl = resolve(decl, base_dir)
    try:
        tracer = Tracer(decl, loop)
    except (OSError, ImportError) as exc:
        raise StartupError(f"observability.tracing ({decl.exporter}): {exc}") from None
    return tracer
