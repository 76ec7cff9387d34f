"""The job store: every polled job from its submission until it is dropped, its answers as they
came, and the rules that bound them (docs/JOBS.md). The one writer of job state; it reads the
time from the clock it is given and sends nothing (the wing, jobs.py, answers callers).

A job's id carries the broker's life (`boot`, drawn at start): an id of another life is answered
"jobs do not survive a broker restart", a well-formed id of this life that was never issued (or
a malformed one) "unknown job". A job that ended is kept `keep_s`, then expired; the ids of
expired and evicted jobs are remembered (the newest REMEMBERED of them) so that a late poll is
told what happened and when, rather than "unknown". Bounds: `max_jobs` held (running and kept),
`max_result_bytes` of outputs held by all jobs together: a job whose outputs would pass it first
makes the oldest ended jobs go (evicted), then, if it still does not fit, fails with
PAYLOAD_TOO_LARGE. Every drop is counted (`counts`).
"""
from __future__ import annotations

import secrets
from collections import Counter, OrderedDict
from typing import Any, Callable

from tgw.shm.errors import Code, TgwError, fail
from tgw.shm.wire import ErrorBody

REMEMBERED = 10_000   # ids of expired or evicted jobs remembered, to answer a late poll clearly
BOOT_CHARS = 8        # secrets.token_urlsafe(6)
SECRET_CHARS = 24     # secrets.token_urlsafe(18): 144 random bits
ENDED = ("done", "failed", "cancelled")


class Job:
    """One job. `caller` stands in for a socket identity at the door (the wing's JobCaller)."""
    __slots__ = ("id", "model", "version", "tenant", "generate", "state", "submitted", "started", "ended",
                 "caller", "req_id", "result", "metas", "parts", "total", "end", "error", "nbytes", "waiters")

    def __init__(self, job_id: str, model: str, tenant: str | None, generate: bool, now: float):
        self.id, self.model, self.version, self.tenant, self.generate = job_id, model, "", tenant, generate
        self.state = "queued"
        self.submitted, self.started, self.ended = now, None, None
        self.caller: Any = None
        self.req_id = 0
        self.result: tuple[list, list[bytes]] | None = None   # a one-shot's (output metas, frames)
        # a generation's outputs so far: the first message's tensor descriptions, and per declared
        # output its rows joined (outputs 0 .. total - 1)
        self.metas: list = []
        self.parts: list[bytearray] = []
        self.total = 0
        self.end: dict = {}                 # a generation's end (reason, seed, ...)
        self.error: ErrorBody | None = None
        self.nbytes = 0                     # bytes of outputs held
        self.waiters: list = []             # long polls waiting for a change (the wing's)

    @property
    def over(self) -> bool:
        return self.state in ENDED


class JobStore:
    def __init__(self, max_jobs: int, max_result_bytes: int, keep_s: float, clock: Callable[[], float],
                 boot: str | None = None):
        self.max_jobs, self.max_result_bytes, self.keep_s, self.clock = max_jobs, max_result_bytes, keep_s, clock
        self.boot = boot or secrets.token_urlsafe(6)
        self.jobs: dict[str, Job] = {}
        self.ended: OrderedDict[str, Job] = OrderedDict()      # ended jobs, oldest end first
        self.gone: OrderedDict[str, tuple[float, str]] = OrderedDict()   # id -> (when, "expired" | "evicted")
        self.nbytes = 0
        self.counts: Counter = Counter()   # submitted, done, failed, cancelled, expired, evicted, refused, too_large

    # ---- submission and answers -------------------------------------------------------------

    def new(self, model: str, tenant: str | None, generate: bool) -> Job:
        """A new job, queued; OVERLOADED when max_jobs are held."""
        now = self.clock()
        self.sweep(now)
        if len(self.jobs) >= self.max_jobs:
            self.counts["refused"] += 1
            raise fail(Code.OVERLOADED, f"{len(self.jobs)} jobs are held, the most this broker keeps (jobs.max_jobs); "
                       f"ended jobs are kept {self.keep_s:g} s (jobs.keep_s): fetch or cancel yours, or retry later",
                       reason="max_jobs", limit=self.max_jobs)
        job = Job(f"{self.boot}.{secrets.token_urlsafe(18)}", model, tenant, generate, now)
        self.jobs[job.id] = job
        self.counts["submitted"] += 1
        return job

    def forget(self, job: Job) -> None:
        """A submission refused at once (its request never admitted): not a job after all."""
        self.jobs.pop(job.id, None)
        self.counts["submitted"] -= 1

    def started_now(self, job: Job) -> None:
        if job.state == "queued":
            job.state, job.started = "running", self.clock()

    def outputs(self, job: Job, first: int, count: int, metas: list, frames: list) -> bool:
        """A generation's outputs `first` .. `first + count - 1` appended (those already held are
        skipped); False when they do not fit (the job failed)."""
        skip = job.total - first
        if job.over or skip >= count:
            return True
        if skip < 0:   # the door answers in order: a gap is a broker bug, failed loudly rather than kept wrong
            gap = fail(Code.INTERNAL, f"job {job.id}: outputs from {first} came after {job.total}")
            self.failed(job, gap.to_body())
            return False
        rows = [memoryview(f)[skip * (len(f) // count):] for f in frames]
        if not self._room(job, sum(map(len, rows))):
            return False
        self.started_now(job)
        if not job.parts:
            job.metas, job.parts = metas, [bytearray() for _ in frames]
        for part, row in zip(job.parts, rows):
            part += row
        job.total = first + count
        return True

    def result(self, job: Job, version: str, metas: list, frames: list[bytes]) -> bool:
        """A one-shot request's answer: done; False when it does not fit (the job failed)."""
        if job.over:
            return True
        if not self._room(job, sum(map(len, frames))):
            return False
        job.version, job.result = version, (metas, frames)
        self._end(job, "done")
        return True

    def finished(self, job: Job, version: str, end: dict) -> None:
        """A generation's end: done."""
        if not job.over:
            job.version, job.end = version, end
            self._end(job, "done")

    def failed(self, job: Job, error: ErrorBody) -> None:
        if not job.over:
            job.error = error
            self._end(job, "failed")

    def cancelled(self, job: Job) -> bool:
        """Cancelled by its caller: True when it was still running (its request is to be withdrawn)."""
        if job.over:
            return False
        self._end(job, "cancelled")
        return True

    # ---- lookup -----------------------------------------------------------------------------

    def get(self, job_id: str, tenant: str | None) -> Job:
        """The job, read by its submitting tenant; JOB_NOT_FOUND saying why it is not here."""
        now = self.clock()
        self.sweep(now)
        job = self.jobs.get(job_id) if isinstance(job_id, str) else None
        if job is not None and job.tenant == tenant:
            return job
        if job is not None:   # another tenant's: answered as unknown, so ids do not leak across tenants
            raise self._unknown(job_id, " (or not yours: a job is read by the tenant that submitted it)")
        gone = self.gone.get(job_id)
        if gone is not None:
            at, why = gone
            if why == "expired":
                raise fail(Code.JOB_NOT_FOUND, f"job {job_id} expired {now - at:.0f} s ago: a result is kept "
                           f"{self.keep_s:g} s after its job ends (jobs.keep_s)", job_id=job_id, reason="expired")
            raise fail(Code.JOB_NOT_FOUND, f"job {job_id} was dropped {now - at:.0f} s ago to make room for newer "
                       f"results (jobs.max_result_bytes: {self.max_result_bytes} bytes for all jobs)", job_id=job_id,
                       reason="evicted")
        boot, dot, secret = job_id.partition(".") if isinstance(job_id, str) else ("", "", "")
        if dot and len(boot) == BOOT_CHARS and len(secret) == SECRET_CHARS and boot != self.boot:
            raise fail(Code.JOB_NOT_FOUND, f"unknown job {job_id}: jobs do not survive a broker restart (this id was "
                       "issued by an earlier broker run)", job_id=job_id, reason="earlier_run")
        raise self._unknown(job_id)

    def _unknown(self, job_id, why: str = "") -> TgwError:
        return fail(Code.JOB_NOT_FOUND, f"unknown job {str(job_id)[:64]!r}{why}", job_id=str(job_id)[:64],
                    reason="unknown")

    def expires_in(self, job: Job, now: float) -> float | None:
        return None if job.ended is None else max(0.0, job.ended + self.keep_s - now)

    # ---- bounds -----------------------------------------------------------------------------

    def sweep(self, now: float) -> None:
        """Expire the ended jobs kept past keep_s."""
        ended = self.ended
        while ended:
            job = next(iter(ended.values()))
            if job.ended + self.keep_s > now:
                break
            self._drop(job, "expired", job.ended + self.keep_s)

    def _room(self, job: Job, n: int) -> bool:
        """Make room for `n` more bytes of `job`'s: the oldest ended jobs go first; False (the job
        failed, what it held released) when even then they do not fit."""
        while self.nbytes + n > self.max_result_bytes and self.ended:
            self._drop(next(iter(self.ended.values())), "evicted", self.clock())
        if self.nbytes + n > self.max_result_bytes:
            held, wanted = self.nbytes - job.nbytes, job.nbytes + n
            self.counts["too_large"] += 1
            self._release(job)
            job.parts, job.result = [], None
            job.error = fail(Code.PAYLOAD_TOO_LARGE, f"job {job.id}: its outputs ({wanted} bytes so far) "
                             f"would pass jobs.max_result_bytes ({self.max_result_bytes} bytes for all jobs, "
                             f"{held} held by running jobs)", limit=self.max_result_bytes).to_body()
            self._end(job, "failed")
            return False
        job.nbytes += n
        self.nbytes += n
        return True

    def _release(self, job: Job) -> None:
        self.nbytes -= job.nbytes
        job.nbytes = 0

    def _end(self, job: Job, state: str) -> None:
        job.state, job.ended = state, self.clock()
        self.counts[state] += 1
        self.ended[job.id] = job

    def _drop(self, job: Job, why: str, at: float) -> None:
        self.jobs.pop(job.id, None)
        self.ended.pop(job.id, None)
        self._release(job)
        self.counts[why] += 1
        self.gone[job.id] = (at, why)
        while len(self.gone) > REMEMBERED:
            self.gone.popitem(last=False)

    def as_dict(self) -> dict:
        """What status and /metrics show: held jobs by state, bytes held, and the counts."""
        states = Counter(job.state for job in self.jobs.values())
        return {"live": states["queued"] + states["running"], "kept": len(self.ended), "bytes": self.nbytes,
                "max_jobs": self.max_jobs, "max_result_bytes": self.max_result_bytes, "keep_s": self.keep_s,
                **{k: self.counts[k] for k in ("submitted", "done", "failed", "cancelled", "expired", "evicted",
                                               "refused", "too_large")}}
