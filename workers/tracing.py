"""The worker's observability, as its start-up (shm/wire_start.WorkerStart) sets it.

* log_format "json": log lines (and the death notice's traceback) as JSON objects, one a line;
  "text": time, level, process (worker<id>[pid]), logger, message. Either way what else the
  process writes to fds 1 and 2 is captured as records (shm/log_lines.py).
* tracing (the broker's observability.tracing, resolved): a `tgw.batch` span per batch, linked
  to the trace context of each request in it (Batch.traces), exported the same way as the
  broker's spans. Kept when one of its requests' contexts is sampled; with none, by sample_ratio.
* slow_ms (observability.slow_request_ms): a batch computing longer than that is logged,
  naming its requests' trace ids; at most one line every INTERVAL_S, the next one saying how
  many were left out. (A failed batch is logged always, by failure_log.py.)

Nothing is imported from opentelemetry unless tracing is set.
"""
from __future__ import annotations

import logging
import os
import random
import sys
import time
from collections import Counter

from tgw.shm.log_lines import JsonRecord, capture_output, text_format, torch_loggers
from tgw.shm.wire import Batch, Done

from .load_errors import watch_torch_warnings

log = logging.getLogger("tgw.worker")
INTERVAL_S = 1.0


class JsonLines(JsonRecord):
    """A worker's JSON record (shm/log_lines.py): "process": "worker<id>"."""


def setup_logging(log_format: str, worker_id: int | None = None) -> None:
    """Log as the broker does: JSON lines, or text lines with time, level and process; either
    way on the real stderr, with everything else written to fds 1 and 2 (prints, torch's C++
    warnings, Python's warnings) captured as records of the same kind (shm/log_lines.py)."""
    process = "worker" if worker_id is None else f"worker{worker_id}"
    handler = logging.StreamHandler(capture_output())
    handler.setFormatter(JsonLines(process) if log_format == "json" else logging.Formatter(text_format(process)))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    logging.captureWarnings(True)
    torch_logs_as_records()
    watch_torch_warnings()   # a failed load's cause can be in one (workers/load_errors.py)


def torch_logs_as_records() -> None:
    """torch's Python loggers keep their records to themselves and write each line of a message
    to stderr with their own prefix: a logged traceback became one captured record per line.
    Sent through the root's handler instead, a message is one record of the process's format."""
    import torch  # noqa: F401  first: its import sets up the handlers of its loggers
    for torch_log in torch_loggers():
        own = [h for h in torch_log.handlers if type(h) is logging.StreamHandler]
        if own and not torch_log.propagate:   # (its trace loggers, with handlers of their own kind, stay)
            for handler in own:
                torch_log.removeHandler(handler)
            torch_log.propagate = True


def death_notice(what: str) -> None:
    """The traceback of what stops the worker (the supervisor logs its death after it)."""
    log.error("%s", what, exc_info=True, extra={"event": "worker_error"})


def trace_ids(batch: Batch) -> list[str]:
    return list(dict.fromkeys(tp[3:35] for tp in batch.traces if tp))


class Observer:
    """Spans for each batch the worker answers, and lines for the slow ones (Server._complete)."""

    def __init__(self, tracing: dict | None, slow_ms: float | None):
        self.slow_us = slow_ms * 1000 if slow_ms else None
        self.spans = BatchSpans(tracing) if tracing else None
        self.logged: dict[str, float] = {}   # kind -> when its last line was logged
        self.left_out: Counter = Counter()    # kind -> lines not logged since

    def batch(self, batch: Batch, done: Done, start_ns: int, end_ns: int) -> None:
        if self.spans is not None:
            self.spans.emit(batch, done, start_ns, end_ns)
        if done.error is None and self.slow_us is not None and done.compute_us > self.slow_us:
            self._log(batch, done)

    def close(self) -> None:
        if self.spans is not None:
            self.spans.provider.shutdown()   # the last spans written (or sent)

    def _log(self, batch: Batch, done: Done) -> None:
        now, kind = time.monotonic(), "slow_batch"
        if now - self.logged.get(kind, -INTERVAL_S) < INTERVAL_S:
            self.left_out[kind] += 1
            return
        self.logged[kind] = now
        ids, left_out = trace_ids(batch), self.left_out.pop(kind, 0)
        log.warning("batch %d of %s:%s slow: %d row(s), compute %.1f ms%s%s", batch.batch_id, batch.model,
                    batch.version, batch.rows, done.compute_us / 1000,
                    f", traces {' '.join(ids[:16])}" if ids else "",
                    f" ({left_out} more not logged)" if left_out else "",
                    extra={"event": kind, "batch_id": batch.batch_id,
                           "model": batch.model, "version": batch.version, "rows": batch.rows,
                           "code": "OK", "compute_ms": done.compute_us / 1000,
                           "trace_ids": ids, "left_out": left_out})


class BatchSpans:
    def __init__(self, decl: dict):
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        self.api, self.ratio = trace, decl["sample_ratio"]
        self.provider = TracerProvider(resource=Resource.create({"service.name": decl["service_name"],
                                                                 "service.instance.id": f"worker-{os.getpid()}"}))
        self.provider.add_span_processor(processor(decl))
        self.tracer = self.provider.get_tracer("tgw.worker")

    def emit(self, batch: Batch, done: Done, start_ns: int, end_ns: int) -> None:
        api = self.api
        contexts = [api.SpanContext(int(tp[3:35], 16), int(tp[36:52], 16), is_remote=True,
                                    trace_flags=api.TraceFlags(int(tp[53:55], 16))) for tp in batch.traces if tp]
        # as the broker's sampler: the callers' flags decide (one sampled is enough), else the ratio
        if not (any(c.trace_flags.sampled for c in contexts) if contexts else random.random() < self.ratio):
            return
        span = self.tracer.start_span(
            "tgw.batch", kind=api.SpanKind.CONSUMER, start_time=start_ns, links=[api.Link(c) for c in contexts],
            attributes={"tgw.batch_id": batch.batch_id, "tgw.model": batch.model, "tgw.version": batch.version,
                        "tgw.rows": batch.rows, "tgw.requests": len(batch.splits), "tgw.compute_us": done.compute_us,
                        "tgw.code": done.error.code if done.error else "OK"})
        if done.error is not None:
            span.set_status(api.Status(api.StatusCode.ERROR, done.error.code))
        span.end(end_time=end_ns)


def processor(decl: dict):
    """Where the worker's spans go: as the broker's (broker/observe/tracing.py `exporter`)."""
    from opentelemetry.sdk.trace import export
    if decl["exporter"] != "otlp":   # file (appended to, as the broker and the other workers do) or stdout
        out = open(decl["path"], "a", encoding="utf-8") if decl["exporter"] == "file" else sys.stdout  # noqa: SIM115
        return export.SimpleSpanProcessor(export.ConsoleSpanExporter(out=out, formatter=one_line))
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    return export.BatchSpanProcessor(OTLPSpanExporter(**({"endpoint": decl["endpoint"]} if decl["endpoint"] else {})))


def one_line(span) -> str:
    return span.to_json(indent=None) + "\n"
