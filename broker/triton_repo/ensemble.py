"""A Triton ensemble as a tgw pipeline: ensemble_scheduling's steps ordered so that each runs
after the steps whose tensors it reads (Triton lets them be listed in any order)."""
from __future__ import annotations

import re

from .notes import Notes

LOCAL = re.compile(r"^[A-Za-z0-9_-]{1,64}$")   # a pipeline input's or step's name (config/pipelines.py)


def step_name(model: str, taken: set[str]) -> str:
    base = re.sub(r"[^A-Za-z0-9_-]", "_", model)[:60] or "step"
    name, k = base, 2
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    taken.add(name)
    return name


def pipeline(config, name: str, folders: list[int], notes: Notes) -> dict | None:
    inputs = [t.name for t in config.input]
    outputs = [t.name for t in config.output]
    for t in inputs:
        if not LOCAL.match(t):
            notes.refuse(f"input {t}", "an ensemble input's name is letters, digits, _ and - (at most 64)")
    steps = list(config.ensemble_scheduling.step)
    if not steps:
        notes.refuse("ensemble_scheduling", "an ensemble needs at least one step")
    if not inputs or not outputs:
        notes.refuse("input/output", "an ensemble declares its inputs and outputs")
    made: dict[str, str] = {}            # ensemble tensor -> "<step>.<model output>"
    for i, s in enumerate(steps):
        for model_output, tensor in s.output_map.items():
            if tensor in made or tensor in inputs:
                notes.refuse(f"ensemble_scheduling: step {i} ({s.model_name}): output_map",
                             f"tensor {tensor!r} is written twice (by an earlier step or as an ensemble input)")
    if notes.refusals:
        return None
    ordered, taken, left = [], set(), list(enumerate(steps))
    while left:   # Kahn's order: a step whose sources all exist runs next; ties keep the file's order
        ready = [(i, s) for i, s in left if all(t in inputs or t in made for t in s.input_map.values())]
        if not ready:
            unmet = sorted({t for _, s in left for t in s.input_map.values() if t not in inputs and t not in made})
            notes.refuse("ensemble_scheduling", f"tensors {unmet} are read by a step but neither an ensemble input "
                         "nor written by a step (or the steps form a cycle)")
            return None
        i, s = ready[0]
        left.remove((i, s))
        label = step_name(s.model_name, taken)
        step = {"name": label, "model": s.model_name,
                "inputs": {model_input: made.get(tensor, tensor) for model_input, tensor in s.input_map.items()}}
        if s.model_version >= 0:
            step["version"] = str(s.model_version)
        ordered.append(step)
        made.update({tensor: f"{label}.{model_output}" for model_output, tensor in s.output_map.items()})
    missing = [t for t in outputs if t not in made]
    if missing:
        notes.refuse("output", f"ensemble outputs {missing} are not written by any step")
        return None
    if config.ensemble_scheduling.max_inflight_requests:
        notes.warn("ensemble_scheduling: max_inflight_requests", "tgw's pipelines bound their steps by each "
                   "model's own queue")
    scheduled = [f.name for f, _ in config.ListFields() if f.name in
                 ("dynamic_batching", "sequence_batching", "instance_group", "model_warmup", "response_cache")]
    for f in scheduled:
        notes.warn(f, "an ensemble's steps are scheduled by their own models")
    return {"name": name, "version": str(folders[-1]) if folders else "1", "inputs": inputs, "steps": ordered,
            "outputs": {t: made[t] for t in outputs}}
