"""Polled jobs, the pure parts (docs/JOBS.md): the job store's rules under an injected clock -
ids that carry the broker's life, expiry after keep_s and the memory of expired ids, max_jobs,
max_result_bytes (oldest ended jobs evicted first, then the job fails), tenants - and the wing's
answers over a recording door: a refusal at submit is no job, a generation's outputs read from
`since`, a long poll answered by the next output, a cancel withdrawing the request."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
from fake_clock import Clock

from tgw.broker.jobs.jobs import Jobs, outputs_since
from tgw.broker.jobs.store import JobStore
from tgw.shm.errors import Code, TgwError, fail
from tgw.shm.wire import PROTOCOL_VERSION as V, ErrorReply, GenerateEnd, GenerateOutputs, GenerateParams, Infer, \
    InferReply, JobAccepted, JobCancel, JobQuery, JobStatus, TensorMeta

pytestmark = pytest.mark.unit


def store(clock, **kw) -> JobStore:
    return JobStore(kw.pop("max_jobs", 4), kw.pop("max_result_bytes", 1024), kw.pop("keep_s", 60.0), clock, **kw)


def meta(n: int = 1) -> list:
    return [TensorMeta(name="y", dtype="int64", shape=[n])]


def code_and_message(call) -> tuple[Code, str]:
    with pytest.raises(TgwError) as info:
        call()
    return info.value.code, info.value.message


def test_ids_carry_the_broker_life_and_unknown_ones_say_why():
    clock = Clock()
    earlier, now = store(clock), store(clock)
    job = now.new("m", None, False)
    assert now.get(job.id, None) is job and job.id.startswith(now.boot + ".") and len(job.id) == 33
    assert now.new("m", None, False).id != job.id
    old = earlier.new("m", None, False).id
    code, message = code_and_message(lambda: now.get(old, None))
    assert code is Code.JOB_NOT_FOUND and "jobs do not survive a broker restart" in message
    for random_id in ("nonsense", f"{now.boot}.{'x' * 24}", old[:-1], ""):
        code, message = code_and_message(lambda: now.get(random_id, None))
        assert code is Code.JOB_NOT_FOUND and message.startswith("unknown job") and "restart" not in message


def test_an_ended_job_is_kept_keep_s_then_expired_and_remembered():
    clock = Clock()
    s = store(clock, keep_s=60.0)
    job = s.new("m", None, False)
    clock.t += 500   # a running job never expires
    s.sweep(clock.t)
    assert s.get(job.id, None) is job
    assert s.result(job, "1", meta(), [b"\0" * 8]) and job.state == "done" and s.nbytes == 8
    clock.t += 59
    assert s.get(job.id, None) is job and s.expires_in(job, clock.t) == pytest.approx(1.0)
    clock.t += 11
    code, message = code_and_message(lambda: s.get(job.id, None))
    assert code is Code.JOB_NOT_FOUND and f"job {job.id} expired 10 s ago" in message and "jobs.keep_s" in message
    assert s.nbytes == 0 and s.as_dict()["expired"] == 1 and s.as_dict()["kept"] == 0


def test_max_jobs_refuses_a_submission_until_one_expires():
    clock = Clock()
    s = store(clock, max_jobs=2, keep_s=10.0)
    a, _ = s.new("m", None, False), s.new("m", None, False)
    code, message = code_and_message(lambda: s.new("m", None, False))
    assert code is Code.OVERLOADED and "jobs.max_jobs" in message and s.counts["refused"] == 1
    s.failed(a, fail(Code.INTERNAL, "x").to_body())
    clock.t += 10
    assert s.new("m", None, False).state == "queued"   # the ended one expired: room again


def test_max_result_bytes_evicts_the_oldest_ended_then_fails_the_job():
    clock = Clock()
    s = store(clock, max_result_bytes=1024)
    first, second, big = (s.new("m", None, True) for _ in range(3))
    assert s.result(first, "1", meta(), [b"a" * 400]) and s.result(second, "1", meta(), [b"b" * 400])
    assert s.outputs(big, 0, 1, meta(), [b"c" * 500]) and big.state == "running"
    code, message = code_and_message(lambda: s.get(first.id, None))   # dropped to make room
    assert code is Code.JOB_NOT_FOUND and "to make room for newer results" in message
    assert s.get(second.id, None) is second and s.nbytes == 900
    assert not s.outputs(big, 1, 1, meta(), [b"c" * 700])   # 1,200 bytes would not fit even alone
    assert big.state == "failed" and big.error.code == "PAYLOAD_TOO_LARGE" and "jobs.max_result_bytes" in \
        big.error.message
    assert s.nbytes == 0 and s.as_dict()["evicted"] == 2 and s.as_dict()["too_large"] == 1


def test_a_job_is_read_by_its_tenant_only():
    s = store(Clock())
    job = s.new("m", "acme", False)
    assert s.get(job.id, "acme") is job
    code, message = code_and_message(lambda: s.get(job.id, "other"))
    assert code is Code.JOB_NOT_FOUND and "not yours" in message


def test_a_generation_s_outputs_are_joined_and_read_from_since():
    s = store(Clock())
    job = s.new("g", None, True)
    assert s.outputs(job, 0, 2, meta(2), [np.array([10, 11]).tobytes()])
    assert s.outputs(job, 1, 3, meta(3), [np.array([11, 12, 13]).tobytes()])   # a repeated position skipped
    assert job.total == 4 and s.nbytes == 32
    metas, frames = outputs_since(job, 1)
    assert metas[0].shape == [3] and np.frombuffer(frames[0], np.int64).tolist() == [11, 12, 13]
    assert not s.outputs(job, 6, 1, meta(1), [np.array([15]).tobytes()])   # a gap: failed, never kept wrong
    assert job.state == "failed" and job.error.code == "INTERNAL"


class Door:
    """The door's calls the wing makes, recorded; `refuse`: the next infer is refused at once."""

    def __init__(self):
        self.sent, self.infers, self.dropped = [], [], []
        self.refuse: TgwError | None = None

    def reply(self, ident, msg, *frames):
        if type(ident) is not bytes:   # as the door: a caller object is delivered to
            return ident.deliver(msg, frames)
        self.sent.append((ident, msg, [bytes(f) for f in frames]))

    def error(self, ident, req_id, err, model=None):
        self.reply(ident, ErrorReply(v=V, id=req_id, error=err.to_body()))

    def infer(self, caller, msg, frames, header=None):
        if self.refuse is not None:
            return self.error(caller, msg.id, self.refuse)
        self.infers.append((caller, msg))

    def drop_caller(self, caller, reason):
        self.dropped.append((caller, reason))
        return 1


def wing(clock=None) -> tuple[Jobs, Door]:
    door = Door()
    loop = asyncio.new_event_loop()
    return Jobs(store(clock or Clock()), loop, 1000, door.reply, door.error, door.infer, door.drop_caller,
                lambda caller, req_id: None), door


def test_a_refusal_at_submit_is_no_job_and_a_one_shot_answer_is_its_result():
    jobs, door = wing()
    door.refuse = fail(Code.MODEL_NOT_FOUND, "no model 'x'")
    jobs.submit(b"me", Infer(v=V, id=7, model="x", inputs=[], job=True), [])
    (_, refusal, _), = door.sent
    assert isinstance(refusal, ErrorReply) and refusal.id == 7 and refusal.error.code == "MODEL_NOT_FOUND"
    assert jobs.store.jobs == {} and jobs.store.counts["submitted"] == 0
    door.refuse, door.sent = None, []
    jobs.submit(b"me", Infer(v=V, id=8, model="m", inputs=[], job=True), [])
    (_, accepted, _), = door.sent
    (caller, inner), = door.infers
    assert isinstance(accepted, JobAccepted) and accepted.id == 8 and inner.job is False and inner.id == 8
    caller.deliver(InferReply(v=V, id=8, model="m", version="1", outputs=meta()), [np.array([5]).tobytes()])
    jobs.query(b"me", JobQuery(v=V, id=9, job_id=accepted.job_id))
    _, status, frames = door.sent[-1]
    assert isinstance(status, JobStatus) and (status.id, status.state, status.version) == (9, "done", "1")
    assert np.frombuffer(frames[0], np.int64).tolist() == [5] and status.run_ms is not None


def test_a_generation_read_from_since_a_long_poll_woken_and_a_cancel():
    jobs, door = wing()
    jobs.submit(b"me", Infer(v=V, id=1, model="g", inputs=[], job=True, generate=GenerateParams()), [])
    job_id = door.sent[-1][1].job_id
    (caller, _), = door.infers
    caller.deliver(GenerateOutputs(v=V, id=1, first=0, count=2, outputs=meta(2)), [np.array([1, 2]).tobytes()])
    jobs.query(b"me", JobQuery(v=V, id=2, job_id=job_id, since=2, wait_ms=500))   # nothing new yet: it waits
    assert door.sent[-1][1].id != 2
    caller.deliver(GenerateOutputs(v=V, id=1, first=2, count=1, outputs=meta(1)), [np.array([3]).tobytes()])
    _, status, frames = door.sent[-1]
    assert (status.id, status.state, status.first, status.count, status.total) == (2, "running", 2, 1, 3)
    assert np.frombuffer(frames[0], np.int64).tolist() == [3]
    jobs.cancel(b"me", JobCancel(v=V, id=3, job_id=job_id))
    assert door.dropped == [(caller, "cancelled")] and door.sent[-1][1].state == "cancelled"
    caller.deliver(GenerateEnd(v=V, id=1, model="g", version="1", reason="cancelled", outputs=3), [])
    assert jobs.store.jobs[job_id].state == "cancelled"   # a late answer changes nothing


def test_a_generation_past_max_result_bytes_fails_and_is_withdrawn():
    jobs, door = wing()
    jobs.submit(b"me", Infer(v=V, id=1, model="g", inputs=[], job=True, generate=GenerateParams()), [])
    job_id = door.sent[-1][1].job_id
    (caller, _), = door.infers
    caller.deliver(GenerateOutputs(v=V, id=1, first=0, count=2, outputs=meta(2)), [bytes(16)])
    caller.deliver(GenerateOutputs(v=V, id=1, first=2, count=200, outputs=meta(200)), [bytes(1600)])
    assert door.dropped == []   # withdrawn once the door is done with this answer, not inside it
    jobs.loop.call_soon(jobs.loop.stop)
    jobs.loop.run_forever()
    assert door.dropped == [(caller, "job_too_large")]
    jobs.query(b"me", JobQuery(v=V, id=2, job_id=job_id))
    status = door.sent[-1][1]
    assert status.state == "failed" and status.error.code == "PAYLOAD_TOO_LARGE" and status.count == 0
    assert status.outputs == [] and status.total == 2 and jobs.store.nbytes == 0
