"""GPU identity across processes: the one rule for comparing device UUIDs.

NVML spells a GPU "GPU-<uuid>" and a MIG instance "MIG-<uuid>"; torch prints the bare "<uuid>"
(with or without the prefix, depending on its version), in either case. Two spellings name the
same device when they agree without the prefix, lower case.
"""
from __future__ import annotations

PREFIXES = ("gpu-", "mig-")


def norm_uuid(uuid: str) -> str:
    """`uuid` without its NVML prefix, lower case ("" stays "")."""
    uuid = uuid.strip().lower()
    for prefix in PREFIXES:
        if uuid.startswith(prefix):
            return uuid[len(prefix):]
    return uuid
