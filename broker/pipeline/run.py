"""One request through a pipeline: its tensors by name, the steps sent and answered, its answer.

Every step whose inputs are all there is sent at once, as an internal request through the
front door (the same admission, queues, batches and answers as a caller's), with a StepCaller
standing in for the caller's identity. The step's reply frames are views of a worker's output
arena, valid only while it is delivered: they are copied once, and the copy is the next
step's input frame (admission copies it into that worker's ring) or the pipeline's output.
"""
from __future__ import annotations

from itertools import count
from typing import Any

from msgspec.structs import replace

from tgw.shm.errors import Code, TgwError, fail
from tgw.shm.wire import PROTOCOL_VERSION, ErrorBody, ErrorReply, Infer, InferReply, TensorMeta

from tgw.broker.front.outbound import packed
from tgw.broker.front.regions import SliceFrame

from .counters import PipelineCounters
from .plan import Plan, StepPlan

STEP_IDS = count(1)   # internal request ids (each StepCaller is its own caller, so they need not be dense)


class StepCaller:
    """A step's stand-in for a caller identity: the front door answers it through deliver()."""
    __slots__ = ("run", "step", "req_id", "sent_at")
    internal = True   # admission: no per-caller cap, no tenant (the pipeline's entry counted both)

    def __init__(self, run: "Run", step: StepPlan, req_id: int, sent_at: float):
        self.run, self.step, self.req_id, self.sent_at = run, step, req_id, sent_at

    def deliver(self, msg, frames) -> None:
        run = self.run
        try:
            run.arrived(self, msg, frames)
        except Exception as exc:   # a broker bug: must not break the completion that delivers it
            run.owner.deps.note("broker_error", type(exc).__name__, f"{self.step.label(run.plan.name)}: its "
                                "reply failed inside the broker", exc_info=True)
            run.fail(fail(Code.INTERNAL, f"broker error: {type(exc).__name__}: {exc}"))

    def __repr__(self) -> str:
        return f"{self.step.label(self.run.plan.name)}"


class Run:
    __slots__ = ("owner", "plan", "counters", "ident", "msg", "values", "deadline", "tenant", "sent", "done",
                 "inflight", "over")

    def __init__(self, owner: Any, plan: Plan, counters: PipelineCounters, ident: Any, msg: Infer,
                 values: dict, deadline: float, tenant: Any):
        # owner: the executor.Pipelines that started it (its deps; `ended` does the accounting)
        self.owner, self.plan, self.counters, self.ident, self.msg = owner, plan, counters, ident, msg
        self.values = values            # source ("x" or "step.output") -> (TensorMeta, frame)
        self.deadline, self.tenant = deadline, tenant
        self.sent: set[str] = set()     # steps handed to the door
        self.done: set[str] = set()     # steps answered with outputs
        self.inflight: dict[str, StepCaller] = {}   # steps sent and not yet answered
        self.over = False               # answered or abandoned: nothing more is sent, late replies are dropped

    # ---- sending -----------------------------------------------------------------------------

    def submit(self) -> None:
        """Send every step not yet sent whose inputs are all there."""
        for step in self.plan.steps:
            if self.over:   # a step refused at once (its error answered the run) stops the rest
                return
            if step.name not in self.sent and step.needs <= self.done:
                self.send(step)

    def send(self, step: StepPlan) -> None:
        now = self.owner.deps.clock()
        left_ms = int((self.deadline - now) * 1000)
        if left_ms < 1:   # it could not finish in time: not sent (its model counts no request)
            return self.fail(fail(Code.DEADLINE_EXCEEDED, f"{step.label(self.plan.name)}: the pipeline's deadline "
                                  "passed before this step could be sent", pipeline=self.plan.name, step=step.name,
                                  model=step.model))
        metas, frames = [], []
        for target, source in step.feeds:
            meta, frame = self.values[source]
            metas.append(replace(meta, name=target) if meta.region is None else
                         replace(meta, name=target, region=None, offset=0))   # a region's slice: resolved already
            frames.append(frame)
        msg = self.msg
        infer = Infer(v=PROTOCOL_VERSION, id=next(STEP_IDS), model=step.model, inputs=metas, version=step.version,
                      outputs=step.wanted, timeout_ms=left_ms, priority=msg.priority, routing_key=msg.routing_key,
                      traceparent=msg.traceparent)
        caller = StepCaller(self, step, infer.id, now)
        self.sent.add(step.name)
        self.inflight[step.name] = caller
        self.counters.step(step.name, step.model).sent += 1
        self.owner.deps.infer(caller, infer, frames)   # a refusal is delivered to the caller at once

    # ---- answers -----------------------------------------------------------------------------

    def arrived(self, caller: StepCaller, msg, frames) -> None:
        if not isinstance(msg, (InferReply, ErrorReply)):
            return   # e.g. the CancelReply to a step cancelled with its run
        step = caller.step
        if self.inflight.get(step.name) is caller:
            del self.inflight[step.name]
        ok = isinstance(msg, InferReply)
        self.counters.step(step.name, step.model).answered(ok, self.owner.deps.clock() - caller.sent_at)
        if self.over:
            return   # another branch failed, or the caller left: dropped
        if not ok:
            return self.fail_step(step, msg.error)
        for meta, frame in zip(msg.outputs, frames):   # the frames are arena views: copied now, once
            data = bytes(frame)
            self.values[f"{step.name}.{meta.name}"] = (TensorMeta(name=meta.name, dtype=meta.dtype,
                                                                  shape=list(meta.shape)), SliceFrame(memoryview(data)))
        self.done.add(step.name)
        if len(self.done) == len(self.plan.steps):
            self.complete()
        else:
            self.submit()

    def complete(self) -> None:
        msg, plan = self.msg, self.plan
        metas, payload = [], []
        for name in msg.outputs if msg.outputs is not None else plan.output_names:
            src = plan.output_sources[name]
            meta, frame = self.values[f"{src.step}.{src.name}"]
            raw, compression = packed(msg.compress_outputs, frame.buffer) if msg.compress_outputs else \
                (frame.buffer, None)
            metas.append(TensorMeta(name=name, dtype=meta.dtype, shape=meta.shape, compression=compression))
            payload.append(raw)
        self.over = True
        self.owner.ended(self, None)
        self.owner.deps.reply(self.ident, InferReply(v=PROTOCOL_VERSION, id=msg.id, model=plan.name,
                                                     version=plan.version, outputs=metas,
                                                     traceparent=msg.traceparent), *payload)

    def fail_step(self, step: StepPlan, error: ErrorBody) -> None:
        """A step's error answers the run: its code, the message naming the step."""
        details = {**error.details, "pipeline": self.plan.name, "step": step.name, "model": step.model}
        self.answer_error(ErrorBody(code=error.code, message=f"{step.label(self.plan.name)}: {error.message}",
                                    retryable=error.retryable, details=details))

    def fail(self, err: TgwError) -> None:
        err.details.setdefault("pipeline", self.plan.name)
        self.answer_error(err.to_body())

    def answer_error(self, body: ErrorBody) -> None:
        if self.over:
            return
        self.over = True
        self.owner.ended(self, body.code)
        self.owner.deps.reply(self.ident, ErrorReply(v=PROTOCOL_VERSION, id=self.msg.id, error=body,
                                                     traceparent=self.msg.traceparent))

    def abandon(self) -> None:
        """Nobody waits for the answer: send nothing more, and take its queued steps out unrun."""
        if self.over:
            return
        self.over = True
        self.owner.ended(self, None, abandoned=True)
        for caller in list(self.inflight.values()):
            self.owner.deps.cancel_step(caller, caller.req_id)
