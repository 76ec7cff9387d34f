"""Which numbered folders of a model become its versions: Triton's version_policy (latest N,
all, specific; default latest 1)."""
from __future__ import annotations

import os

from .notes import Notes


def folders(model_dir: str) -> list[int]:
    """The model's numbered version folders, ascending (Triton ignores other names)."""
    try:
        names = os.listdir(model_dir)
    except OSError:
        return []
    # "01" would be version 1 to Triton and a second name for it here: only canonical numbers count
    return sorted(int(n) for n in names
                  if n.isdigit() and str(int(n)) == n and os.path.isdir(os.path.join(model_dir, n)))


def chosen(config, model_dir: str, notes: Notes) -> list[str]:
    """The versions the policy serves, ascending, as folder names."""
    have = folders(model_dir)
    policy = config.version_policy
    which = policy.WhichOneof("policy_choice") if config.HasField("version_policy") else None
    if which == "all":
        picked = have
    elif which == "specific":
        wanted = sorted(set(policy.specific.versions))
        missing = [v for v in wanted if v not in have]
        if missing:
            notes.refuse("version_policy: specific", f"versions {missing} have no folder in {model_dir}")
        picked = [v for v in wanted if v in have]
    else:
        n = policy.latest.num_versions if which == "latest" else 1
        if which == "latest" and n < 1:
            notes.refuse("version_policy: latest", f"num_versions {n}: at least 1")
        picked = have[-n:] if n >= 1 else []
    if not picked and not notes.refusals:
        notes.refuse("version_policy", f"no numbered version folder in {model_dir} (Triton would serve none)")
    return [str(v) for v in picked]
