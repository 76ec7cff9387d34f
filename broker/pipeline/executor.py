"""The pipelines the broker serves and the entry of a request naming one.

The front door hands such a request here instead of to admission (it looks the name up in
`table`). The entry checks the request against the pipeline's inputs (names, dtypes, count;
each step's admission checks shapes), counts it once against its caller's in-flight cap and
its tenant's quota (as admission would a model request), and starts a Run (run.py). The
steps are internal requests, exempt from both. `table`, the counters and the runs have one
writer: this object.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from tgw.shm.errors import Code, TgwError, fail
from tgw.shm.wire import PROTOCOL_VERSION, ErrorReply, Infer, ModelMetadata

from tgw.broker.config.pipelines import PipelineDecl
from tgw.broker.models.checks import count_words, dtype_words

from .counters import PipelineCounters
from .plan import Plan
from .run import Run


@dataclass(frozen=True)
class PipelineDeps:
    """What the pipelines read and call of the rest of the broker (core/assembly.py builds it)."""
    models: dict                                 # the registry's model entries by name
    clock: Callable[[], float]
    infer: Callable[[Any, Infer, list], None]    # the front door's infer: a step goes in as a request
    reply: Callable[..., None]                   # the front door's reply(ident, msg, *frames)
    cancel_step: Callable[[Any, int], None]      # take a step request out of its queue, unrun (abandon.py)
    owed: Any                                    # sched.admission.Owed: the per-caller in-flight cap
    tenants: Any                                 # sched.tenants.Tenants: the tenant's quota
    is_open: Callable[[], bool]                  # False once the broker is stopping
    note: Callable[..., None]                    # complaints.note: a broker bug, logged rate-limited


class Pipelines:
    def __init__(self, deps: PipelineDeps, decls: list[PipelineDecl]):
        self.deps = deps
        self.table: dict[str, Plan] = {}                 # the front door reads it: names served as pipelines
        self.counters: dict[str, PipelineCounters] = {}
        self.runs: dict[tuple, Run] = {}                 # (caller, request id) -> a run not yet ended
        self.configure(decls)

    def configure(self, decls: list[PipelineDecl]) -> None:
        """The pipelines of a (re)loaded config, checked by its validation; in place, as the door
        holds the table. Runs under way finish on the plan they started with."""
        models = {name: entry.decl for name, entry in self.deps.models.items() if not entry.removed}
        plans = {d.name: Plan(d, models) for d in decls}
        self.table.clear()
        self.table.update(plans)
        for name in plans:
            self.counters.setdefault(name, PipelineCounters())

    # ---- the entry ---------------------------------------------------------------------------

    def start(self, ident, msg: Infer, frames: list) -> None:
        """Check and start a request naming a pipeline; every refusal is answered here."""
        plan = self.table[msg.model]
        counters = self.counters[plan.name]
        try:
            values = self._checked(plan, msg, frames)
            now = self.deps.clock()
            self.deps.owed.check(ident)
            tenants = self.deps.tenants
            tenant = tenants.resolve(msg.tenant) if tenants.in_use else None
            if tenant is not None:
                tenants.admit(tenant, now)
        except TgwError as err:
            err.details.setdefault("pipeline", plan.name)
            counters.errors[err.code.value] += 1
            return self.deps.reply(ident, ErrorReply(v=PROTOCOL_VERSION, id=msg.id, error=err.to_body()))
        timeout_ms = plan.timeout_ms if msg.timeout_ms is None else min(plan.timeout_ms, msg.timeout_ms)
        run = Run(self, plan, counters, ident, msg, values, now + timeout_ms / 1000.0, tenant)
        self.deps.owed.owe(ident)
        self.runs[ident, msg.id] = run
        counters.requests += 1
        counters.inflight += 1
        run.submit()

    def _checked(self, plan: Plan, msg: Infer, frames: list) -> dict:
        """The request's tensors by input name, or the TgwError that refuses it."""
        name = plan.name
        if not self.deps.is_open():
            raise fail(Code.MODEL_NOT_READY, "broker is shutting down", reason="shutting_down")
        if msg.version is not None and msg.version != plan.version:
            raise fail(Code.VERSION_NOT_FOUND, f"pipeline {name!r} has no version {msg.version!r} (it is version "
                       f"{plan.version!r})", model=name, version=msg.version, available=[plan.version])
        if msg.output_region is not None or msg.output_cuda:
            raise fail(Code.INVALID_ARGUMENT, f"pipeline {name!r}: outputs into a region or CUDA buffers are not "
                       "served for pipelines; its outputs come back as frames")
        if len(frames) != len(msg.inputs):
            raise fail(Code.INVALID_ARGUMENT, f"pipeline {name!r}: {len(msg.inputs)} tensors in the header but "
                       f"{len(frames)} tensor frames")
        # Triton's checks and words, an ensemble being a model to its clients (models/checks.py)
        names, expected = [t.name for t in msg.inputs], list(plan.input_specs)
        unknown = [n for n in names if n not in plan.input_specs]
        if len(names) != len(expected) or len(set(names)) != len(names):
            raise fail(Code.INVALID_ARGUMENT, count_words(name, expected, names), expected=expected, got=names)
        if unknown:
            raise fail(Code.INVALID_ARGUMENT, f"unexpected inference input '{unknown[0]}' for model '{name}'",
                       input=unknown[0], expected=expected)
        values = {}
        for meta, frame in zip(msg.inputs, frames):
            spec = plan.input_specs[meta.name]
            if meta.dtype != spec.dtype:
                raise fail(Code.INVALID_INPUT_DTYPE, dtype_words(name, meta.name, meta.dtype, spec.dtype),
                           input=meta.name, expected=spec.dtype, got=meta.dtype)
            if meta.cuda is not None:
                raise fail(Code.INVALID_ARGUMENT, f"pipeline {name!r} input {meta.name!r}: CUDA tensors by handle "
                           "are not taken by pipelines; send its bytes", input=meta.name)
            values[meta.name] = (meta, frame)
        unknown = [n for n in msg.outputs or () if n not in plan.output_sources]
        if unknown:
            raise fail(Code.INVALID_ARGUMENT, f"unexpected inference output '{unknown[0]}' for model '{name}'",
                       outputs=unknown)
        return values

    def ended(self, run: Run, code: str | None, abandoned: bool = False) -> None:
        """A run's one exit: its caller's and tenant's accounts, the counters."""
        key = (run.ident, run.msg.id)
        if self.runs.get(key) is run:
            del self.runs[key]
        self.deps.owed.paid(run.ident)
        if run.tenant is not None:
            run.tenant.inflight -= 1
        c = run.counters
        c.inflight -= 1
        if abandoned:
            c.abandoned += 1
        elif code is None:
            c.replies += 1
        else:
            c.errors[code] += 1

    # ---- abandonment (front/abandon.py calls these) ------------------------------------------

    def cancel(self, ident, req_ids) -> int:
        """The runs of these ids stop: how many."""
        runs = [r for i in req_ids if (r := self.runs.get((ident, i))) is not None]
        for run in runs:
            run.abandon()
        return len(runs)

    def drop(self, idents: set) -> int:
        """Every run of these callers stops (they closed, or their process is gone): how many."""
        runs = [r for (ident, _), r in self.runs.items() if ident in idents]
        for run in runs:
            run.abandon()
        return len(runs)

    # ---- what others ask ---------------------------------------------------------------------

    def blocking(self, model: str, versions: list[str], routable_left: list[str]) -> str:
        """Why unloading `versions` of `model` (leaving `routable_left` ready) would break a
        pipeline; "" when it would not."""
        broken = []
        for plan in self.table.values():
            for step in plan.uses(model):
                if step.version is not None and step.version in versions:
                    broken.append(f"pipeline {plan.name!r} step {step.name!r} is pinned to {model}:{step.version}")
                elif step.version is None and not routable_left:
                    broken.append(f"pipeline {plan.name!r} step {step.name!r} uses {model} and no version would be "
                                  "left")
        return "; ".join(broken)

    def metadata(self, name: str | None, ready: Callable[[Plan], bool]) -> list[ModelMetadata]:
        """The pipeline named (none: every one) as native Metadata shows it; [] for a non-pipeline."""
        plans = list(self.table.values()) if name is None else [self.table[name]] if name in self.table else []
        return [p.metadata(ready(p)) for p in plans]

    def as_dict(self, ready: Callable[[Plan], bool]) -> dict:
        return {name: {"version": plan.version, "ready": ready(plan), "steps_order": [s.name for s in plan.steps],
                       **self.counters[name].as_dict()} for name, plan in self.table.items()}
