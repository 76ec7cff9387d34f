"""The wire contract of jobs: requests answered at once with an id, their result fetched later
(docs/JOBS.md, docs/PROTOCOL.md "Jobs").

Imported through tgw.shm.wire like every other message.

A caller submits an ordinary `infer` (a one-shot request, a pipeline, or a generation with
`generate`) with `job` set: the broker answers at once with `JobAccepted` (the job's id) and
runs the request through the same admission and batching as any other, its answers kept by the
broker. `JobQuery` reads the job's state, its outputs so far (a generation's from position
`since`) and, once it is done, its result or its error, as one `JobStatus` whose tensors travel
in the frames that follow it (as an InferReply's); with `wait_ms` the answer waits (bounded)
until the job's state changes or new outputs arrive. `JobCancel` withdraws the request wherever
it is and answers the job's JobStatus, state `cancelled`.
"""
from __future__ import annotations

from typing import Any, Literal, Optional

from .wire_base import ErrorBody, Struct, TensorMeta

JOB_STATES = ("queued", "running", "done", "failed", "cancelled")
JobState = Literal["queued", "running", "done", "failed", "cancelled"]


# ---- caller -> broker -------------------------------------------------------------------------


class JobQuery(Struct, tag_field="op", tag="job_get"):
    """Read a job: answered by JobStatus (or an error: JOB_NOT_FOUND)."""
    v: int
    id: int
    job_id: str
    # a generation's outputs from this position on (a one-shot: >= 1 leaves its result out)
    since: int = 0
    wait_ms: int = 0                   # > 0: answer when the state changes or outputs past `since` arrive
    token: Optional[str] = None
    tenant: Optional[str] = None       # a job is read by the tenant that submitted it


class JobCancel(Struct, tag_field="op", tag="job_cancel"):
    """Cancel a job: its request is withdrawn wherever it is; answered by JobStatus."""
    v: int
    id: int
    job_id: str
    token: Optional[str] = None
    tenant: Optional[str] = None


# ---- broker -> caller -------------------------------------------------------------------------


class JobAccepted(Struct, tag_field="op", tag="job_accepted"):
    """The answer to an `infer` with `job` set: the job exists (its request is admitted)."""
    v: int
    id: int
    job_id: str
    model: str
    generate: bool = False             # a generation: its outputs can be read as they come
    keep_s: float = 0.0                # how long its result is kept after it ends


class JobStatus(Struct, tag_field="op", tag="job_status"):
    """A job as it stands. `outputs` (their bytes in the frames that follow): for a generation,
    outputs `first` .. `first + count - 1`, one tensor [count, *shape] per declared output; for a
    one-shot request, its result once `state` is done and the query's `since` is 0, else none."""
    v: int
    id: int
    job_id: str
    model: str
    state: JobState
    generate: bool = False
    version: str = ""
    outputs: list[TensorMeta] = []
    first: int = 0
    count: int = 0
    total: int = 0                     # a generation's outputs so far, in all
    error: Optional[ErrorBody] = None  # state failed (or cancelled with a reason)
    # a generation's end (state done): reason, seed, resumed, first_output_ms, as GenerateEnd's
    end: dict[str, Any] = {}
    age_ms: float = 0.0                # since it was submitted
    run_ms: Optional[float] = None     # submission -> its end (None: not ended)
    expires_in_s: Optional[float] = None   # ended: how long it is still kept
