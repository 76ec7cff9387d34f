"""The jobs wing at the door: a job's submission, reads, long polls and cancel (docs/JOBS.md).

The front door hands it every `infer` with `job` set. It makes the job (store.py), answers the
submitter at once with JobAccepted, and sends the request back through the door's ordinary
`infer` with a JobCaller standing in for a socket identity: the same admission, queues, batches,
pipelines and generations as any request, whose answers the caller gives to the store. A request
the door refuses at once (unknown model, bad input, over a limit) is no job: the submitter gets
the refusal itself. Cancel withdraws the request through the door's `drop_caller` (a generation
ends at its worker's next step). A long poll (`wait_ms`) waits here, answered by the job's next
change or its timer, whichever comes first.
"""
from __future__ import annotations

from typing import Any, Callable

import msgspec

from tgw.shm.errors import TgwError
from tgw.shm.wire import PROTOCOL_VERSION, ErrorReply, GenerateEnd, GenerateOutputs, Infer, InferReply, JobAccepted, \
    JobCancel, JobQuery, JobStatus, TensorMeta

from .store import Job, JobStore


class JobCaller:
    """A job's stand-in for a socket identity at the door: it hands every answer to the wing."""
    __slots__ = ("jobs", "job", "refusal")
    face = "job"

    def __init__(self, jobs: "Jobs", job: Job):
        self.jobs, self.job = jobs, job
        self.refusal: ErrorReply | None = None   # the door refused the request while it was being submitted

    def deliver(self, msg, frames) -> None:
        self.jobs.answered(self, msg, frames)

    def __repr__(self) -> str:
        return f"job {self.job.id[:12]}..."


class Jobs:
    def __init__(self, store: JobStore, loop, max_wait_ms: int, reply: Callable, error: Callable,
                 infer: Callable, drop_caller: Callable, admitted: Callable[[Any, int], Any]):
        # reply(ident, msg, *frames) / error(ident, req_id, err, model): the door's answers;
        # infer(caller, msg, frames, header): the door's; drop_caller(caller, reason): withdraw its
        # requests; admitted(caller, req_id): its Pending while admitted and unanswered, else None
        self.store, self.loop, self.max_wait_ms = store, loop, max_wait_ms
        self.reply, self.error, self.infer, self.drop_caller, self.admitted = reply, error, infer, drop_caller, admitted
        self._submitting: Job | None = None

    # ---- the door's routes --------------------------------------------------------------------

    def submit(self, ident, msg: Infer, frames: list, header=None) -> None:
        store = self.store
        try:
            job = store.new(msg.model, msg.tenant, msg.generate is not None)
        except TgwError as err:
            return self.error(ident, msg.id, err, msg.model)
        caller = job.caller = JobCaller(self, job)
        job.req_id = msg.id
        self._submitting = job
        try:
            self.infer(caller, msgspec.structs.replace(msg, job=False), frames, header)
        finally:
            self._submitting = None
        if caller.refusal is not None:   # refused at the door: no job, the submitter hears why
            store.forget(job)
            return self.reply(ident, caller.refusal)
        self.reply(ident, JobAccepted(v=PROTOCOL_VERSION, id=msg.id, job_id=job.id, model=msg.model,
                                      generate=job.generate, keep_s=store.keep_s))

    def query(self, ident, msg: JobQuery) -> None:
        try:
            job = self.store.get(msg.job_id, msg.tenant)
        except TgwError as err:
            return self.error(ident, msg.id, err)
        since = max(0, msg.since)
        if msg.wait_ms > 0 and not job.over and (not job.generate or job.total <= since):
            wait_s = min(msg.wait_ms, self.max_wait_ms) / 1000
            waiter = [ident, msg, None]
            waiter[2] = self.loop.call_later(wait_s, self._waited, job, waiter)
            job.waiters.append(waiter)
            return
        self._answer(ident, msg.id, job, since)

    def cancel(self, ident, msg: JobCancel) -> None:
        try:
            job = self.store.get(msg.job_id, msg.tenant)
        except TgwError as err:
            return self.error(ident, msg.id, err)
        if self.store.cancelled(job):
            self.drop_caller(job.caller, "cancelled")
            self._changed(job)
        self._answer(ident, msg.id, job, job.total)

    def sweep(self, now: float) -> None:
        self.store.sweep(now)

    # ---- a job's answers ----------------------------------------------------------------------

    def answered(self, caller: JobCaller, msg, frames) -> None:
        job, store = caller.job, self.store
        kind = type(msg)
        if kind is GenerateOutputs:
            if not store.outputs(job, msg.first, msg.count, msg.outputs, frames):
                # over jobs.max_result_bytes: the generation is withdrawn, once the door is done with this answer
                self.loop.call_soon(self.drop_caller, caller, "job_too_large")
        elif kind is InferReply:
            store.result(job, msg.version, msg.outputs, [bytes(f) for f in frames])
        elif kind is GenerateEnd:
            store.finished(job, msg.version, {"reason": msg.reason, "outputs": msg.outputs, "seed": msg.seed,
                                              "first_output_ms": msg.first_output_ms, "total_ms": msg.total_ms,
                                              "resumed": msg.resumed})
        elif kind is ErrorReply:
            if self._submitting is job and job.state == "queued":
                caller.refusal = msg
                return
            store.failed(job, msg.error)
        else:
            return
        self._changed(job)

    def _changed(self, job: Job) -> None:
        waiters, job.waiters = job.waiters, []
        for ident, msg, timer in waiters:
            timer.cancel()
            self._answer(ident, msg.id, job, max(0, msg.since))

    def _waited(self, job: Job, waiter: list) -> None:
        if waiter in job.waiters:
            job.waiters.remove(waiter)
            self._answer(waiter[0], waiter[1].id, job, max(0, waiter[1].since))

    # ---- the answer ---------------------------------------------------------------------------

    def _answer(self, ident, req_id: int, job: Job, since: int) -> None:
        now = self.store.clock()
        state = job.state
        if state == "queued":
            p = self.admitted(job.caller, job.req_id)
            if p is None or p.dispatched is not None:   # on a worker, in a generation's loop, or a pipeline's run
                self.store.started_now(job)
                state = job.state
        metas, frames, first, count = [], [], 0, 0
        if job.generate:
            # a job failed over max_result_bytes holds none of its outputs any more
            first, count = min(since, job.total), max(0, job.total - since) if job.parts else 0
            metas, frames = outputs_since(job, since) if count else ([], [])
        elif job.result is not None and since == 0:   # since >= 1: the caller holds the result already
            metas, frames = job.result
        status = JobStatus(v=PROTOCOL_VERSION, id=req_id, job_id=job.id, model=job.model, state=state,
                           generate=job.generate, version=job.version, outputs=metas, first=first, count=count,
                           total=job.total, error=job.error, end=job.end, age_ms=(now - job.submitted) * 1000,
                           run_ms=None if job.ended is None else (job.ended - job.submitted) * 1000,
                           expires_in_s=self.store.expires_in(job, now))
        self.reply(ident, status, *frames)


def outputs_since(job: Job, since: int) -> tuple[list[TensorMeta], list[bytes]]:
    """A generation's outputs from position `since` on, one tensor [n, *shape] per declared output."""
    n = job.total - since
    frames = [bytes(memoryview(part)[since * (len(part) // job.total):]) for part in job.parts]
    return [TensorMeta(name=m.name, dtype=m.dtype, shape=[n, *m.shape[1:]]) for m in job.metas], frames
