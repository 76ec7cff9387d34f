"""Which workers hold which versions: models on model workers, stages where they run.

Every worker has a role the supervisor gives it at plan time: "models" (a GPU worker, or a CPU
worker while workers.stage_workers makes a pool for the cpu stages), "stages" (one of
workers.stage_workers' CPU workers: cpu stages only) or "models+stages" (a CPU worker when
there is no such pool: models and cpu stages). A model goes on the model workers; a stage with
`device: cuda` on the GPU workers; a stage with `device: cpu` on the workers whose role has
"stages". The scheduler only picks workers that hold a version, so these load sets suffice.
"""
from __future__ import annotations

MODELS, STAGES, BOTH = "models", "stages", "models+stages"


def roles_for(devices: list[str], stage_workers: int) -> list[str]:
    """The roles of the planned workers: one per device, then the stage workers' (all on cpu)."""
    cpu_role = MODELS if stage_workers else BOTH
    return [cpu_role if d == "cpu" else MODELS for d in devices] + [STAGES] * stage_workers


def serves(role: str, device: str, is_stage: bool, stage_device: str | None) -> bool:
    """Whether a worker of `role` on `device` holds a version of this model (or stage)."""
    parts = role.split("+")
    if not is_stage:
        return MODELS in parts
    if stage_device == "cuda":
        return device.startswith("cuda") and MODELS in parts
    return STAGES in parts


def placement_problems(models, devices: list[str], roles: list[str]) -> list[str]:
    """Each stage no planned worker would hold, with what to set (ModelDecls `models`)."""
    problems = []
    planned = list(zip(roles, devices))
    for m in models:
        if not m.is_stage or any(serves(r, d, True, m.device) for r, d in planned):
            continue
        if m.device == "cuda":
            problems.append(f"stage {m.name!r} declares device: cuda, but no worker is on a GPU (workers.devices: "
                            f"{devices}): give the workers a GPU, or set device: cpu on the stage")
        else:
            problems.append(f"stage {m.name!r} runs on the CPU, but every worker is a GPU worker (workers.devices: "
                            f"{devices}) and workers.stage_workers is 0: set workers.stage_workers: 1 (or more), "
                            "or add cpu to workers.devices")
    return problems
