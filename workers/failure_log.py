"""A WARNING line for every failed batch (or the requests a stage failed in one), always.

Each line names the model, version, batch, code, rows and requests, the requests' trace ids
when they carry any, and for an exception in handler or model code its type, message and
file:line (failure_where.py; the serving code notes the exception before answering). A storm
is not one line per batch: at most LINES_PER_S lines a second per model version, the next line
saying how many were left out.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from tgw.shm.errors import TgwError
from tgw.shm.wire import Batch, Done

from .failure_where import code_where
from .tracing import trace_ids

log = logging.getLogger("tgw.worker")
LINES_PER_S = 5
WINDOW_S = 1.0
MESSAGE_CHARS = 300


def failed_ids(batch: Batch, done: Done) -> list[int]:
    """The ids of the requests `done` failed: those of its part, or those a stage failed."""
    if not batch.ids:
        return []
    if done.error is None:
        return [batch.ids[i] for i in sorted(done.failed) if i < len(batch.ids)]
    return batch.ids[done.first:done.first + done.count] if done.count else batch.ids[done.first:]


def one_line(message: str) -> str:
    """A message as one bounded line: a multi-line one (TorchScript's, its interpreter's traceback
    first) by its last line, where the error itself is."""
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else "")[:MESSAGE_CHARS]


class FailureLog:
    """Owned by the serving loop (serve.Server): `note` an exception as it is caught, `batch`
    each answer; the one writer of its windows and notes."""

    def __init__(self, lines_per_s: int = LINES_PER_S, clock: Callable[[], float] = time.monotonic):
        self.lines_per_s, self.clock = lines_per_s, clock
        self.windows: dict[str, tuple[float, int]] = {}   # model:version -> (window start, lines in it)
        self.left_out: dict[str, int] = {}                # model:version -> lines not logged since its last
        self.notes: dict[int, str] = {}                   # batch id -> the exception and where it came from

    def note(self, batch_id: int, exc: BaseException, code_file: str = "") -> None:
        """The exception a batch failed with, told as "Type: message (at file:line)"; a TgwError
        (the request's own fault, as caller_faults.py tells it) is told by its answer alone."""
        if isinstance(exc, TgwError):
            return
        where = code_where(exc, code_file)
        text = f"{type(exc).__name__}: {one_line(str(exc))}"
        self.notes[batch_id] = text + (f" (at {where})" if where else "")

    def batch(self, batch: Batch, done: Done) -> None:
        """Log `done` if it failed the batch or some of its requests; forget the batch's note."""
        note = self.notes.pop(batch.batch_id, None)
        if done.error is None and not done.failed:
            return
        key = f"{batch.model}:{batch.version}"
        if not self._admit(key):
            return
        left_out = self.left_out.pop(key, 0)
        requests = len(batch.splits) or 1
        if done.error is not None:
            code, what = done.error.code, note or one_line(done.error.message)
            count = done.count or requests - done.first
        else:   # rows a stage failed: each request answered with the stage's message
            first = next(iter(done.failed.values()))
            code, what, count = first.code, one_line(first.message), len(done.failed)
        ids, request_ids = trace_ids(batch), failed_ids(batch, done)
        log.warning("%s failed %s: batch %d, %d of %d request(s)%s, %d row(s): %s%s%s", key, code, batch.batch_id,
                    count, requests, f" (ids {' '.join(map(str, request_ids[:16]))})" if request_ids else "",
                    batch.rows, what, f"; traces {' '.join(ids[:16])}" if ids else "",
                    f" ({left_out} more failure line(s) of {key} left out)" if left_out else "",
                    extra={"event": "batch_failed", "model": batch.model, "version": batch.version,
                           "batch_id": batch.batch_id, "code": code, "requests": count, "rows": batch.rows,
                           "request_ids": request_ids, "trace_ids": ids, "left_out": left_out, **({"where": note} if note else {})})

    def _admit(self, key: str) -> bool:
        now = self.clock()
        start, lines = self.windows.get(key, (now, 0))
        if now - start >= WINDOW_S:
            start, lines = now, 0
        if lines >= self.lines_per_s:
            self.left_out[key] = self.left_out.get(key, 0) + 1
            self.windows[key] = (start, lines)
            return False
        self.windows[key] = (start, lines + 1)
        return True
