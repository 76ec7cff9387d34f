"""Which live workers look hung - a pure judgement over heartbeats, with the time passed in.

A worker is hung when its heartbeats stop for hang_timeout_s (SIGSTOP, a native deadlock
holding the GIL, a machine too loaded to schedule it), or when the batch it reports computing
has run longer than max(batch_timeout_s, batch_timeout_factor x the time the cost model predicts
for a batch of its rows on that worker) (a deadlock that releases the GIL: the beats go on, the
batch never ends).
"""
from __future__ import annotations

from tgw.broker.config.load import SupervisorDecl
from tgw.broker.sched.costmodel import CostModel
from tgw.broker.state.pool import WorkerHandle, WorkerState

WATCHED = (WorkerState.STARTING, WorkerState.READY, WorkerState.STOPPING)


class HangJudge:
    def __init__(self, decl: SupervisorDecl, costs: CostModel, start_timeout_s: float):
        self.decl, self.costs = decl, costs
        # before its first beat a worker is starting its interpreter and importing torch
        self.first_beat_s = max(decl.hang_timeout_s, start_timeout_s)

    def batch_limit_s(self, model: str, rows: int = 1, worker: int | None = None) -> float:
        predicted = self.costs.predict(model, rows, worker)
        return max(self.decl.batch_timeout_s, self.decl.batch_timeout_factor * predicted)

    def hung(self, workers: list[WorkerHandle], now: float) -> list[tuple[WorkerHandle, str]]:
        """(worker, reason) for each watched worker that should be killed and replaced."""
        out = []
        for w in workers:
            if w.state not in WATCHED or w.kill_reason:
                continue
            silent = now - w.beat_at  # since the last beat arrived, or the life began
            if w.beat is None and silent > self.first_beat_s:
                out.append((w, f"no first heartbeat {silent:.1f} s after it started"))
                continue
            if w.beat is not None and silent > self.decl.hang_timeout_s:
                out.append((w, f"no heartbeat for {silent:.1f} s (hang_timeout_s {self.decl.hang_timeout_s:g})"))
                continue
            beat = w.beat
            if beat is None or beat.batch_id is None or beat.batch_id not in w.inflight:
                continue
            batch = w.inflight[beat.batch_id]
            model = batch.model
            running, limit = now - beat.batch_since, self.batch_limit_s(model, batch.rows, w.worker_id)
            if running > limit:
                out.append((w, f"batch {beat.batch_id} of {model} computing for {running:.1f} s (limit {limit:.1f} s)"))
        return out
