"""The broker's log lines: plain text (the default) or one JSON object per line, and the slow
request log.

`--log-format json` writes each record as {"ts", "level", "logger", "msg", ...} with the
record's `extra` fields (the structured events carry `event` plus their figures: start,
worker_ready, model_load, model_unload, worker_died, breaker, slow_request, ...) and the
exception text as "exc". The supervisor tells the workers the format in use (`format_in_use`,
their WorkerStart), so their lines are JSON too.

Slow requests (observability.slow_request_ms): a request slower end to end than the threshold
is logged with its id, model, version, code, trace id and phase times, at most PER_S lines a
second; the next line logged says how many were left out.
"""
from __future__ import annotations

import logging
import sys

from tgw.shm.log_lines import JsonRecord, capture_output, text_format
from tgw.broker.state.pending import Pending

log = logging.getLogger("tgw.broker")
FORMATS = ("text", "json")
TEXT = text_format("broker")
PER_S = 10                  # slow request lines a second, at most


class JsonFormatter(JsonRecord):
    """The broker's JSON record (shm/log_lines.py), "process": "broker"."""

    def __init__(self) -> None:
        super().__init__("broker")


def setup(fmt: str = "text", level: str = "INFO") -> None:
    """Root logging to stderr in `fmt`; the workers spawned from now on log the same way.

    JSON: every other line the process writes to fd 1 or 2 is captured as a record too
    (shm/log_lines.py). Text: stdout is left as it is (the CLI's progress and answers)."""
    fmt = fmt if fmt in FORMATS else "text"
    handler = logging.StreamHandler(capture_output() if fmt == "json" else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    logging.captureWarnings(fmt == "json")   # Python's warnings as lines of the same format


def format_in_use() -> str:
    """"json" when the root logger writes JSON lines (setup), else "text": what the workers get."""
    return "json" if any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers) else "text"


class SlowRequests:
    """An Admission.on_finished hook: logs requests slower end to end than `threshold_ms`."""

    def __init__(self, threshold_ms: float):
        self.threshold_s = threshold_ms / 1000.0
        self.second = 0.0      # the clock second the lines counted in `lines` belong to
        self.lines = 0
        self.left_out = 0      # slow requests not logged since the last line

    def __call__(self, ps: list[Pending], code: str | None, now: float) -> None:
        for p in ps:
            if now - p.arrived >= self.threshold_s:
                self.slow(p, code, now)

    def slow(self, p: Pending, code: str | None, now: float) -> None:
        total = now - p.arrived
        if now - self.second >= 1.0:
            self.second, self.lines = now, 0
        if self.lines >= PER_S:
            self.left_out += 1
            return
        self.lines += 1
        left_out, self.left_out = self.left_out, 0
        queue = (now if p.dispatched is None else p.dispatched) - p.arrived
        fields = {"event": "slow_request", "request_id": p.req_id, "model": p.model, "version": p.version,
                  "code": code or "OK", "trace_id": p.trace[3:35] if p.trace else None, "rows": p.rows,
                  "priority": p.priority, "queue_ms": round(queue * 1000, 3),
                  "compute_ms": round(p.compute_us / 1000, 3), "total_ms": round(total * 1000, 3),
                  "left_out": left_out}
        log.warning("slow request %d for %s:%s: %.1f ms (queue %.1f ms, compute %.1f ms), %s%s%s", p.req_id,
                    p.model, p.version, fields["total_ms"], fields["queue_ms"], fields["compute_ms"], fields["code"],
                    f", trace {fields['trace_id']}" if p.trace else "",
                    f" ({left_out} more slow request(s) not logged)" if left_out else "", extra=fields)


def slow_requests(threshold_ms: float | None) -> "SlowRequests | None":
    """The hook that logs slow requests, only when a threshold is set; the workers get the
    threshold in their WorkerStart, for slow batches."""
    return None if threshold_ms is None else SlowRequests(threshold_ms)
