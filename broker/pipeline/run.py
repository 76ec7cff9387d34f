"""One request through a pipeline: its tensors by name, the steps sent and answered, its answer.

Every step whose inputs are all there is sent at once, as an internal request through the
front door (the same admission, queues, batches and answers as a caller's), with a StepCaller
standing in for the caller's identity. The door hands a step's outputs over as they are (no
reply message is built): views of a worker's output arena, valid only while it answers. They
are copied once, and the copy is the next step's input frame (a CheckedFrame: its worker
checked it, so admission only copies it into the next worker's ring) or the pipeline's output.
"""
from __future__ import annotations

from itertools import count
from typing import Any

from msgspec.structs import replace

from tgw.shm.errors import Code, TgwError, fail
from tgw.shm.wire import PROTOCOL_VERSION, ErrorBody, ErrorReply, Infer, InferReply, TensorMeta

from tgw.broker.front.outbound import packed
from tgw.broker.sched.inbound import CheckedFrame

from .counters import PipelineCounters, StepCounters
from .plan import Plan, StepPlan

STEP_IDS = count(1)   # internal request ids (each StepCaller is its own caller, so they need not be dense)


class StepCaller:
    """A step's stand-in for a caller identity: the front door answers it through outputs() (its
    rows of the output arena) or deliver() (an error, or the CancelReply of a cancelled step)."""
    __slots__ = ("run", "step", "req_id", "sent_at", "counters")
    # the door and admission: no region, CUDA or pipeline lookup, no per-caller cap, no tenant (the
    # pipeline's entry counted both), answered through outputs()
    internal = True

    def __init__(self, run: "Run", step: StepPlan, req_id: int, sent_at: float, counters: StepCounters):
        self.run, self.step, self.req_id, self.sent_at, self.counters = run, step, req_id, sent_at, counters

    def outputs(self, p, views: dict) -> None:
        """Its answer: `views` are {output: (BlockTensor, its rows' bytes in the output arena)}."""
        try:
            self.run.outputs(self, p, views)
        except Exception as exc:   # a broker bug: must not break the completion that delivers it
            self.run.broke(self, exc)

    def deliver(self, msg, frames) -> None:
        try:
            self.run.arrived(self, msg, frames)
        except Exception as exc:
            self.run.broke(self, exc)

    def __repr__(self) -> str:
        return f"{self.step.label(self.run.plan.name)}"


class Run:
    __slots__ = ("owner", "plan", "counters", "ident", "msg", "values", "deadline", "tenant", "done",
                 "inflight", "over")

    def __init__(self, owner: Any, plan: Plan, counters: PipelineCounters, ident: Any, msg: Infer,
                 values: dict, deadline: float, tenant: Any):
        # owner: the executor.Pipelines that started it (its deps; `ended` does the accounting)
        self.owner, self.plan, self.counters, self.ident, self.msg = owner, plan, counters, ident, msg
        self.values = values            # source ("x" or "step.output") -> (TensorMeta, frame)
        self.deadline, self.tenant = deadline, tenant
        self.done: set[str] = set()     # steps answered with outputs
        self.inflight: dict[str, StepCaller] = {}   # steps sent and not yet answered (sent: these and done)
        self.over = False               # answered or abandoned: nothing more is sent, late replies are dropped

    # ---- sending -----------------------------------------------------------------------------

    def submit(self) -> None:
        """Send every step not yet sent whose inputs are all there."""
        for step in self.plan.steps:
            if self.over:   # a step refused at once (its error answered the run) stops the rest
                return
            if step.needs <= self.done and step.name not in self.done and step.name not in self.inflight:
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
        caller = StepCaller(self, step, infer.id, now, self.counters.step(step.name, step.model))
        self.inflight[step.name] = caller
        caller.counters.sent += 1
        self.owner.deps.infer(caller, infer, frames)   # a refusal is delivered to the caller at once

    # ---- answers -----------------------------------------------------------------------------

    def _answered(self, caller: StepCaller, ok: bool) -> bool:
        """A step's answer counted; whether the run still wants it."""
        step = caller.step
        if self.inflight.get(step.name) is caller:
            del self.inflight[step.name]
        caller.counters.answered(ok, self.owner.deps.clock() - caller.sent_at)
        return not self.over   # else another branch failed, or the caller left: dropped

    def arrived(self, caller: StepCaller, msg, frames) -> None:
        """A step's reply as a message: its error (a step's outputs come through outputs())."""
        if not isinstance(msg, (InferReply, ErrorReply)):
            return   # e.g. the CancelReply to a step cancelled with its run
        ok = isinstance(msg, InferReply)
        if not self._answered(caller, ok):
            return
        if not ok:
            return self.fail_step(caller.step, msg.error)
        step, values = caller.step, self.values
        for meta, frame in zip(msg.outputs, frames):   # views, as outputs() says: copied now, once
            values[f"{step.name}.{meta.name}"] = (TensorMeta(name=meta.name, dtype=meta.dtype, shape=list(meta.shape)),
                                                 CheckedFrame(memoryview(bytes(frame))))
        self.took(step)

    def outputs(self, caller: StepCaller, p, views: dict) -> None:
        """A step's outputs: its rows of the worker's output arena (the door's answer, unpacked
        here instead of into an InferReply). The views are valid only during this call: each is
        copied now, once; the copy is the next step's frame or the reply's."""
        if not self._answered(caller, True):
            return
        step, values, rows = caller.step, self.values, p.rows
        for name in p.outputs:
            block, view = views[name]
            shape = [rows, *block.shape[1:]] if p.batched else list(block.shape[1:])   # a step without a batch dim
            values[f"{step.name}.{name}"] = (TensorMeta(name=name, dtype=block.dtype, shape=shape),
                                            CheckedFrame(memoryview(bytes(view))))
        self.took(step)

    def took(self, step: StepPlan) -> None:
        """A step's outputs are in `values`: the next steps, or the answer."""
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

    def broke(self, caller: StepCaller, exc: Exception) -> None:
        """A broker bug while taking a step's answer: logged, and the run answered INTERNAL."""
        self.owner.deps.note("broker_error", type(exc).__name__, f"{caller.step.label(self.plan.name)}: its reply "
                             "failed inside the broker", exc_info=True)
        self.fail(fail(Code.INTERNAL, f"broker error: {type(exc).__name__}: {exc}"))

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
