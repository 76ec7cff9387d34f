"""Polled jobs on the native client (docs/JOBS.md): `Client.submit` answers at once with a `Job`
whose state, outputs so far and result are read later - from this client, another one, or
another process (`Client.job(id)` re-attaches by id); `AsyncClient.submit` / `.job` give an
`AsyncJob` with the same methods, awaited.

A job is an `infer` with `job` set (docs/PROTOCOL.md, "Jobs"); its reads are `job_get` messages
(JobQuery) answered by `job_status` (JobStatus); `result()` long-polls (wait_ms) until the job
ends. A generation's outputs are fetched once each: the job keeps those it has read and asks
only for the ones after them.
"""
from __future__ import annotations

import math
import time
from typing import Any

from tgw.shm.errors import Code, error_from_body, fail
from tgw.shm.wire import PROTOCOL_VERSION, JobCancel, JobQuery, JobStatus

from .generation import generate_params, one_row
from .request import prepare
from .tensors import decode_outputs

POLL_MS = 10_000   # one long poll of result() (the broker caps it at jobs.max_wait_ms)


class JobCancelled(RuntimeError):
    """result() of a job that was cancelled."""


def submit_call(client, ranks, model: str, inputs: Any, generate: dict | None, options: dict):
    """The prepared request of a submission (an infer with `job` set; a generation's with `generate`)."""
    if generate is not None:
        if not isinstance(generate, dict):
            raise fail(Code.INVALID_ARGUMENT, f"generate must be a dict (max_outputs, sampling, seed), got "
                       f"{type(generate).__name__}")
        unknown = sorted(set(generate) - {"max_outputs", "sampling", "seed"})
        if unknown:
            raise fail(Code.INVALID_ARGUMENT, f"generate has no key {', '.join(map(repr, unknown))}; its keys are "
                       "max_outputs, sampling, seed")
        params = generate_params(generate.get("max_outputs"), generate.get("sampling"), generate.get("seed"))
        inputs = one_row(inputs, ranks)
    call = prepare(client.next_id(), model, inputs, token=client.token, default_tenant=client.tenant,
                   address=client.address, **options)
    call.msg.job = True
    if generate is not None:
        call.msg.generate = params
    return call


class JobState:
    """What the client knows of one job: its last status and a generation's outputs read so far."""

    def __init__(self, job_id: str, tenant: str | None):
        self.id, self.tenant = job_id, tenant
        self.last: JobStatus | None = None
        self.items: list = []          # a generation's outputs read so far, in order
        self.scalar: bool | None = None
        self.result: dict | None = None

    def query(self, wait_ms: int = 0) -> JobQuery:
        since = len(self.items) if self.result is None else 1   # a one-shot's result, once held, is not sent again
        return JobQuery(v=PROTOCOL_VERSION, id=0, job_id=self.id, since=since, wait_ms=wait_ms, tenant=self.tenant)

    def cancel(self) -> JobCancel:
        return JobCancel(v=PROTOCOL_VERSION, id=0, job_id=self.id, tenant=self.tenant)

    def take(self, reply: JobStatus, frames: list) -> None:
        self.last = reply
        if reply.generate:
            if reply.count and reply.first == len(self.items):
                arrays = decode_outputs(reply.outputs, frames)
                if self.scalar is None:
                    self.scalar = len(arrays) == 1 and all(a.ndim == 1 and a.dtype.kind in "iu"
                                                           for a in arrays.values())
                if self.scalar:
                    self.items.extend(next(iter(arrays.values())).tolist())
                else:
                    self.items.extend({k: a[i] for k, a in arrays.items()} for i in range(reply.count))
        elif reply.state == "done" and self.result is None:
            self.result = decode_outputs(reply.outputs, frames)

    def status(self) -> dict:
        r = self.last
        return {"id": r.job_id, "model": r.model, "version": r.version, "state": r.state, "generate": r.generate,
                "outputs": r.total, "error": None if r.error is None else {"code": r.error.code,
                                                                          "message": r.error.message},
                "end": r.end, "age_ms": r.age_ms, "run_ms": r.run_ms, "expires_in_s": r.expires_in_s}

    def outcome(self):
        """The result of an ended job: a one-shot's outputs, a generation's list; raises its error."""
        r = self.last
        if r.state == "failed":
            raise error_from_body(r.error)
        if r.state == "cancelled":
            raise JobCancelled(f"job {self.id} was cancelled")
        return list(self.items) if r.generate else self.result

    def expired(self, waited: float):
        return fail(Code.DEADLINE_EXCEEDED, f"job {self.id} did not end within {waited:.1f}s (it goes on: ask "
                    "again, or cancel it)", job_id=self.id, source="client")


def ended(reply: JobStatus) -> bool:
    return reply.state in ("done", "failed", "cancelled")


def wait_ms_for(until: float | None) -> int:
    if until is None:
        return POLL_MS
    return max(1, min(POLL_MS, math.ceil((until - time.monotonic()) * 1000)))


class Job:
    """A polled job (Client.submit, Client.job). `id` is what another client re-attaches with."""

    def __init__(self, client, job_id: str, tenant: str | None = None):
        self._client, self._state = client, JobState(job_id, tenant)

    @property
    def id(self) -> str:
        return self._state.id

    def _ask(self, msg, wait_ms: int = 0):
        reply, frames = self._client._call_frames(msg, wait_ms / 1000 + self._client.connect_timeout)
        self._state.take(reply, frames)
        return reply

    def status(self) -> dict:
        """state (queued, running, done, failed, cancelled), model, version, outputs (a
        generation's, so far), error, end (a generation's: reason, seed, ...), age_ms, run_ms,
        expires_in_s (how long an ended job is still kept)."""
        self._ask(self._state.query())
        return self._state.status()

    def outputs(self, wait: float = 0.0) -> list:
        """A generation's outputs so far (ints for a token generator, else dicts name -> array);
        with `wait` seconds, the call waits that long at most for new ones (or the job's end)."""
        self._ask(self._state.query(math.ceil(wait * 1000)), math.ceil(wait * 1000))
        return list(self._state.items)

    def result(self, timeout: float | None = None):
        """Wait for the job to end: a one-shot's outputs (name -> array, as infer), a generation's
        list of outputs; raises the job's error (JobCancelled when it was cancelled), or
        DEADLINE_EXCEEDED after `timeout` seconds (the job goes on)."""
        until = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = wait_ms_for(until)
            reply = self._ask(self._state.query(wait), wait)
            if ended(reply) and (reply.state != "done" or not reply.generate or len(self._state.items) >= reply.total):
                return self._state.outcome()
            if until is not None and time.monotonic() >= until:
                raise self._state.expired(timeout)

    def cancel(self) -> dict:
        """Cancel the job (its request is withdrawn wherever it is); its status after."""
        self._ask(self._state.cancel())
        return self._state.status()

    def __repr__(self) -> str:
        return f"Job({self.id!r})"


class AsyncJob:
    """As Job, awaited (AsyncClient.submit, AsyncClient.job)."""

    def __init__(self, client, job_id: str, tenant: str | None = None):
        self._client, self._state = client, JobState(job_id, tenant)

    @property
    def id(self) -> str:
        return self._state.id

    async def _ask(self, msg, wait_ms: int = 0):
        reply, frames = await self._client._call_frames(msg, wait_ms / 1000 + self._client.connect_timeout)
        self._state.take(reply, frames)
        return reply

    async def status(self) -> dict:
        await self._ask(self._state.query())
        return self._state.status()

    async def outputs(self, wait: float = 0.0) -> list:
        await self._ask(self._state.query(math.ceil(wait * 1000)), math.ceil(wait * 1000))
        return list(self._state.items)

    async def result(self, timeout: float | None = None):
        until = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = wait_ms_for(until)
            reply = await self._ask(self._state.query(wait), wait)
            if ended(reply) and (reply.state != "done" or not reply.generate or len(self._state.items) >= reply.total):
                return self._state.outcome()
            if until is not None and time.monotonic() >= until:
                raise self._state.expired(timeout)

    async def cancel(self) -> dict:
        await self._ask(self._state.cancel())
        return self._state.status()

    def __repr__(self) -> str:
        return f"AsyncJob({self.id!r})"
