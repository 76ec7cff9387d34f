"""Which device a worker runs on, as its hello tells the broker: the GPU's UUID and memory.

Its own module because the serving loop's CUDA IPC path (cuda_ipc.py), the beacon (NVML figures
found by UUID) and the worker's start-up all ask it, and none of them should import another.
"""
from __future__ import annotations

import torch


def device_uuid(device: torch.device) -> str:
    """The GPU's UUID as torch prints it ("" on the CPU or when the driver does not say)."""
    if device.type != "cuda":
        return ""
    try:
        return str(torch.cuda.get_device_properties(device).uuid)
    except Exception:
        return ""


def device_memory(device: torch.device) -> int:
    """The GPU's memory in bytes (0 on the CPU)."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
