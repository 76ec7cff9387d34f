"""Requests the broker answers itself because no worker will run them: deadlines passed in
the queue, models no worker may serve (crash loop), a stop with work left, versions unloaded
or failing to load on demand. Every admitted request leaves through an answer; these are the
answers that do not come from a worker.
"""
from __future__ import annotations

from typing import Callable

from tgw.shm.errors import Code, TgwError, fail
from tgw.shm.wire import model_key

from tgw.broker.state.pending import Pending
from tgw.broker.state.pool import WorkerState

EXPIRED = "deadline passed while queued, or would pass during the predicted compute of a batch of its own"


class Unserved:
    def __init__(self, batcher, roster: list, fail: Callable[[Pending, TgwError], None],
                 resident: Callable[[object], bool]):
        # fail: answer an admitted request with an error (the front door's); resident: placement's
        self.batcher, self.roster, self.answer_error, self.resident = batcher, roster, fail, resident

    def sweep(self, now: float, stopping: bool) -> None:
        """Answer what has expired, and what cannot run: no live worker left while stopping, or
        every worker benched."""
        for p in self.batcher.expired(now):
            self.answer_error(p, self.expired(p))
        if stopping:  # no restarts while stopping: what no live worker can run is answered
            live = {k for w in self.roster if w.state is WorkerState.READY for k in w.models}
            for p in self.batcher.take_where(lambda p: model_key(p.model, p.version) not in live):
                self.answer_error(p, fail(Code.MODEL_NOT_READY, "the broker is stopping and no worker is left "
                                    "to run this request", reason="shutting_down"))
        why = self.unavailable()
        if why:
            for p in self.batcher.take_all():
                self.answer_error(p, fail(Code.MODEL_NOT_READY, why, reason="crash_loop"))

    def unavailable(self) -> str:
        """Why no worker may serve now ("" while one may): every worker is benched."""
        roster = self.roster
        if roster and roster[0].benched and all(w.benched for w in roster):  # [0]: the common case is cheap
            return "; ".join(w.benched for w in roster)
        return ""

    def expired(self, p: Pending) -> TgwError:
        """The answer to a request whose deadline came while it was queued."""
        rec = p.record
        if rec is not None and rec.on_demand and not self.resident(rec):
            return fail(Code.MODEL_NOT_READY, f"{rec.key} loads on demand and was not loaded within this request's "
                        "deadline: retry, or allow a longer timeout", reason="loading",
                        load_ms=0.0 if rec.last_load_ms is None else round(rec.last_load_ms, 1))
        return fail(Code.DEADLINE_EXCEEDED, EXPIRED)

    def versions(self, records: list, message: str) -> None:
        """Answer what is still queued for these versions (they are being unloaded)."""
        for p in self.batcher.take_where(lambda p: p.record in records):
            self.answer_error(p, fail(Code.MODEL_NOT_READY, message, reason="unloaded"))

    def everything(self, message: str) -> None:
        """Answer everything still queued or in flight (the shutdown grace ran out)."""
        running = [p for w in self.roster for batch in w.drop_inflight() for p in batch.requests]
        for p in self.batcher.take_all() + running:
            self.answer_error(p, fail(Code.MODEL_NOT_READY, message, reason="shutting_down"))


def answer_load_failure(batcher, answer_error: Callable[[Pending, TgwError], None], key: str, reason: str,
                        error: str) -> None:
    """A version failed to load (on demand, or again after a restart): what waits for it is
    answered with why. A function of the queues alone: placement is given it (core/assembly.py),
    and Unserved reads placement."""
    for p in batcher.take_where(lambda p: p.record is not None and p.record.key == key):
        answer_error(p, fail(Code.MODEL_NOT_READY, f"{key} failed to load ({reason}): {error}",
                             reason="load_failed", retryable=False))
