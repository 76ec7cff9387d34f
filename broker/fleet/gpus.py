"""Which GPUs the workers get: `workers.devices: auto` is one worker per GPU this process may use,
and an explicit `cuda:N` must be one of those. No torch here: NVML (nvidia-ml-py) lists the
box's GPUs and CUDA_VISIBLE_DEVICES is read as the CUDA runtime reads it, so that `cuda:N` here
is torch's `cuda:N` in the worker, which inherits the variable.

CUDA's rules: unset, every GPU; a comma-separated list of indices or UUIDs (`GPU-...`, a unique
prefix is enough; `MIG-...` instances) makes those visible, in that order, up to the first
entry that is invalid (an unknown index or UUID, a repeat); empty, none. A MIG instance is a
device of its own here (mig_instances): one worker each.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

from tgw.shm.devices import norm_uuid

from tgw.broker.config.startup import StartupError
from tgw.broker.config.schema import WorkersDecl

log = logging.getLogger("tgw.supervisor")


def nvml_uuids() -> Optional[list[str]]:
    """The UUIDs of the box's GPUs ("GPU-..."); None where NVML is missing (no driver, no GPU)."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no library or driver: a CPU box
        return None
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
            out.append(uuid.decode() if isinstance(uuid, bytes) else str(uuid))
        return out
    except Exception as exc:  # noqa: BLE001 - a driver that answers init but not this
        log.warning("NVML could not list the GPUs: %s", exc)
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def visible_entries(uuids: list[str], env: Optional[str]) -> list[str]:
    """The GPUs (their UUIDs) and MIG instances (MIG-...) CUDA_VISIBLE_DEVICES=`env` (None: unset)
    leaves, in CUDA's order: cuda:N is the N-th."""
    if env is None:
        return list(uuids)
    seen: list[str] = []
    for entry in (e.strip() for e in env.split(",")):
        if entry.isdigit():
            found = uuids[int(entry)] if int(entry) < len(uuids) else None
        elif entry.upper().startswith("MIG-"):
            found = entry            # a MIG instance: NVML's GPU list does not name them
        else:   # a GPU UUID, "GPU-" optional, any case: a unique prefix of one (shm/devices.py)
            wanted = norm_uuid(entry)
            hits = [u for u in uuids if norm_uuid(u).startswith(wanted)]
            found = hits[0] if len(hits) == 1 else None
        if found is None or found in seen:
            break
        seen.append(found)
    return seen


def visible_count(uuids: list[str], env: Optional[str]) -> int:
    """How many of the GPUs with these UUIDs CUDA_VISIBLE_DEVICES=`env` (None: unset) leaves."""
    return len(visible_entries(uuids, env))


_FROM_ENV = object()


def plan_devices(decl: WorkersDecl, uuids: Optional[list[str]] = None, env=_FROM_ENV) -> list[str]:
    """One device per worker. `uuids` and `env` default to NVML's list and the process's
    CUDA_VISIBLE_DEVICES; StartupError when an explicit cuda:N is not a visible GPU."""
    if uuids is None:
        uuids = nvml_uuids()
    if env is _FROM_ENV:
        env = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = None if uuids is None else visible_count(uuids, env)
    if decl.devices == "auto":
        return [f"cuda:{i}" for i in range(visible or 0)] or ["cpu"]
    where = f" (CUDA_VISIBLE_DEVICES={env!r})" if env is not None else ""
    if visible is None and any(d.startswith("cuda:") for d in decl.devices):
        log.warning("NVML is not available: workers.devices %s cannot be checked before the workers start",
                    decl.devices)
    for k, device in enumerate(decl.devices):
        if device.startswith("cuda:") and visible is not None and int(device[5:]) >= visible:
            raise StartupError(f"workers.devices.{k}: {device} is not a GPU this broker can use: {visible} "
                               f"visible{where}; cuda:N counts the visible GPUs from 0")
    return list(decl.devices)


def mig_instances(devices: list[str], env=_FROM_ENV, uuids: Optional[list[str]] = None) -> dict[str, str]:
    """Planned device (cuda:N) -> its MIG instance's UUID, for those that are MIG instances.

    A CUDA process enumerates at most one MIG instance, so each of these workers is started
    with CUDA_VISIBLE_DEVICES set to its instance alone, and runs on its cuda:0."""
    if env is _FROM_ENV:
        env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None or "MIG-" not in env.upper():
        return {}
    entries = visible_entries(uuids if uuids is not None else nvml_uuids() or [], env)
    return {d: entries[int(d[5:])] for d in devices
            if d.startswith("cuda:") and int(d[5:]) < len(entries) and entries[int(d[5:])].upper().startswith("MIG-")}
