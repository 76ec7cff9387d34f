"""The pipelines' part of the configuration: a served name that is a DAG of steps (stages or
models) over named tensors (docs/PIPELINES.md), and its checks against the models.

A step's inputs map each input of its model to a source: a pipeline input, or
"<earlier step>.<output>". Only earlier steps may be named, so the list order is a topological
order and no cycle can be written. The pipeline's own inputs and outputs (dtype, shape) are not
declared: they are derived from the tensors they feed or come from (`derive`).
"""
from __future__ import annotations

from typing import Annotated, NamedTuple, Optional

from pydantic import Field

from tgw.shm.wire import IOSpec

from .schema_models import ModelDecl, TensorDecl
from .strict import Strict

# step names and pipeline inputs hold no ".": a source "<step>.<output>" is split at its first one
LocalName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]


class StepDecl(Strict):
    name: LocalName
    model: Annotated[str, Field(min_length=1)]    # a model or stage of `models`
    version: Optional[Annotated[str, Field(min_length=1)]] = None   # pinned; None: the model's own routing
    inputs: dict[str, str]                        # the model's input -> a pipeline input or "<step>.<output>"


class PipelineDecl(Strict):
    name: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")]
    version: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$")] = "1"
    timeout_ms: Annotated[int, Field(ge=1)] = 30000   # the whole pipeline's; a request's own wins when shorter
    inputs: Annotated[list[LocalName], Field(min_length=1)]
    steps: Annotated[list[StepDecl], Field(min_length=1)]
    outputs: Annotated[dict[str, str], Field(min_length=1)]   # pipeline output -> "<step>.<output>"


class PipelineError(ValueError):
    """Problems of the pipelines, each with its key path (load.py reports each on its own line)."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("\n".join(f"{path}: {message}" for path, message in problems))


class Source(NamedTuple):
    step: str | None    # None: a pipeline input
    name: str           # the pipeline input's name, or the step's output


def parse_source(text: str) -> Source:
    step, dot, output = text.partition(".")
    return Source(step, output) if dot else Source(None, text)


def shapes_agree(a: list[int], b: list[int]) -> bool:
    return len(a) == len(b) and all(x == y or -1 in (x, y) for x, y in zip(a, b))


def merged(a: list[int], b: list[int]) -> list[int]:
    """The more specific of two agreeing shapes, dim by dim (-1 matches any size)."""
    return [y if x == -1 else x for x, y in zip(a, b)]


def _show(t) -> str:
    return f"{t.dtype} {list(t.shape)}"


def problems(pipelines: list[PipelineDecl], models: list[ModelDecl]) -> list[tuple[str, str]]:
    """Every problem of `pipelines` against `models`, as (key path, message)."""
    by_name = {m.name: m for m in models}
    out: list[tuple[str, str]] = []
    seen: dict[str, int] = {}
    for i, p in enumerate(pipelines):
        where = f"pipelines.{i}"
        if p.name in by_name:
            out.append((f"{where}.name", f"pipeline {p.name!r} has the name of a model; a served name is one "
                        "or the other"))
        if p.name in seen:
            out.append((f"{where}.name", f"duplicate pipeline name {p.name!r} (also at pipelines.{seen[p.name]})"))
        seen.setdefault(p.name, i)
        out += _pipeline_problems(p, where, by_name)
    return out


def _pipeline_problems(p: PipelineDecl, where: str, models: dict[str, ModelDecl]) -> list[tuple[str, str]]:
    out = []
    dupes = sorted({n for n in p.inputs if p.inputs.count(n) > 1})
    if dupes:
        out.append((f"{where}.inputs", f"duplicate pipeline inputs {dupes}"))
    fed: dict[str, tuple] = {}                       # pipeline input -> what it feeds (_step_inputs)
    steps: dict[str, ModelDecl | None] = {}          # earlier steps -> their model (None: unknown)
    for j, step in enumerate(p.steps):
        at = f"{where}.steps.{j}"
        if step.name in steps:
            out.append((f"{at}.name", f"duplicate step name {step.name!r}"))
        model = models.get(step.model)
        if model is None:
            out.append((f"{at}.model", f"no model named {step.model!r} (models: {', '.join(sorted(models))})"))
        elif step.version is not None and step.version not in {v.version for v in model.versions}:
            out.append((f"{at}.version", f"model {step.model!r} has no version {step.version!r} (versions: "
                        f"{', '.join(v.version for v in model.versions)})"))
        if model is not None:
            out += _step_inputs(p, step, at, model, steps, fed)
        steps.setdefault(step.name, model)
    unused = [n for n in dict.fromkeys(p.inputs) if n not in fed]
    if unused:
        out.append((f"{where}.inputs", f"pipeline inputs {unused} feed no step"))
    for name, text in p.outputs.items():
        src = parse_source(text)
        model = steps.get(src.step) if src.step is not None else None
        if src.step is None or src.step not in steps:
            out.append((f"{where}.outputs.{name}", f"{text!r} is not \"<step>.<output>\" of a step of this pipeline "
                        f"(steps: {', '.join(steps)})"))
        elif model is not None and src.name not in {t.name for t in model.outputs}:
            out.append((f"{where}.outputs.{name}", f"step {src.step!r} (model {model.name!r}) has no output "
                        f"{src.name!r} (outputs: {', '.join(t.name for t in model.outputs)})"))
    return out


def _step_inputs(p: PipelineDecl, step: StepDecl, at: str, model: ModelDecl, steps: dict,
                 fed: dict) -> list[tuple[str, str]]:
    out = []
    declared = {t.name: t for t in model.inputs}
    missing = [n for n in declared if n not in step.inputs]
    if missing:
        out.append((f"{at}.inputs", f"model {model.name!r} input(s) {missing} are not mapped (each input of the "
                    "step's model is mapped exactly once)"))
    for target, text in step.inputs.items():
        key = f"{at}.inputs.{target}"
        want = declared.get(target)
        if want is None:
            out.append((key, f"model {model.name!r} has no input {target!r} (inputs: {', '.join(declared)})"))
            continue
        src = parse_source(text)
        if src.step is None:
            if src.name not in p.inputs:
                out.append((key, f"{text!r} is neither a pipeline input ({', '.join(p.inputs)}) nor "
                            "\"<earlier step>.<output>\""))
                continue
            first = fed.get(src.name)   # (dtype, the shapes so far merged, where it was first fed)
            if first is None:
                fed[src.name] = (want.dtype, list(want.shape), key)
            elif first[0] != want.dtype or not shapes_agree(first[1], want.shape):
                out.append((key, f"pipeline input {src.name!r} feeds {_show(want)} here but {first[0]} {first[1]} "
                            f"at {first[2]}; one input must agree in dtype and shape everywhere it goes"))
            else:
                fed[src.name] = (first[0], merged(first[1], list(want.shape)), first[2])
            continue
        if src.step == step.name or src.step not in steps:
            why = "itself" if src.step == step.name else "no earlier step"
            out.append((key, f"{text!r} names {why}: a step reads only pipeline inputs and the outputs of steps "
                        f"listed before it (earlier steps: {', '.join(steps) or 'none'})"))
            continue
        source_model = steps[src.step]
        if source_model is None:
            continue   # its model is unknown: reported there
        have = next((t for t in source_model.outputs if t.name == src.name), None)
        if have is None:
            out.append((key, f"step {src.step!r} (model {source_model.name!r}) has no output {src.name!r} "
                        f"(outputs: {', '.join(t.name for t in source_model.outputs)})"))
        elif have.dtype != want.dtype:
            out.append((key, f"dtype mismatch: {text} is {have.dtype}, model {model.name!r} input {target!r} "
                        f"takes {want.dtype}"))
        elif not shapes_agree(have.shape, want.shape):
            out.append((key, f"shape mismatch: {text} is {list(have.shape)}, model {model.name!r} input "
                        f"{target!r} takes {list(want.shape)} (-1 matches any size)"))
    return out


class Derived(NamedTuple):
    inputs: list[IOSpec]
    outputs: list[IOSpec]
    max_batch_size: int


def derive(p: PipelineDecl, models: dict[str, ModelDecl]) -> Derived:
    """The pipeline's inputs and outputs from the step tensors they feed or come from (for a
    pipeline that passed `problems`), and the largest batch every step takes."""
    shapes: dict[str, TensorDecl] = {}
    merged_shape: dict[str, list[int]] = {}
    step_model = {s.name: models[s.model] for s in p.steps}
    for step in p.steps:
        declared = {t.name: t for t in step_model[step.name].inputs}
        for target, text in step.inputs.items():
            src = parse_source(text)
            if src.step is None:
                t = declared[target]
                shapes.setdefault(src.name, t)
                merged_shape[src.name] = merged(merged_shape.get(src.name, list(t.shape)), list(t.shape))
    inputs = [IOSpec(name=n, dtype=shapes[n].dtype, shape=merged_shape[n]) for n in p.inputs]
    outputs = []
    for name, text in p.outputs.items():
        src = parse_source(text)
        t = next(o for o in step_model[src.step].outputs if o.name == src.name)
        outputs.append(IOSpec(name=name, dtype=t.dtype, shape=list(t.shape)))
    return Derived(inputs, outputs, min(m.max_batch_size for m in step_model.values()))


def describe(p: PipelineDecl, models: dict[str, ModelDecl]) -> str:
    """Two lines for `tgw-broker check-config`: the steps in order, then the derived inputs and outputs."""
    d = derive(p, models)
    chain = " -> ".join(f"{s.name} ({s.model}{':' + s.version if s.version else ''})" for s in p.steps)
    show = lambda specs: ", ".join(f"{t.name} {t.dtype} {t.shape}" for t in specs)   # noqa: E731
    return (f"  pipeline {p.name} (version {p.version}): {chain}\n"
            f"    inputs: {show(d.inputs)}; outputs: {show(d.outputs)}; max_batch_size {d.max_batch_size}, "
            f"timeout_ms {p.timeout_ms}")
