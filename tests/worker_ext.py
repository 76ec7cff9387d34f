"""A preload module for tests (`tgw-worker --preload worker_ext` or `--preload /path/to/worker_ext.py`):
registers two custom ops, callable from TorchScript, that stand in for a deployment's native ops.

    tgw_test::crash_if(Tensor x, float trigger) -> Tensor   aborts the process on a poison input
    tgw_test::cuda_fault_if(Tensor x, float trigger)        raises a sticky CUDA error's message on it
    tgw_test::leak(Tensor x, int nbytes) -> Tensor          leaks nbytes per call
    tgw_test::wait_gate(Tensor x, str path) -> Tensor       holds a batch until the test opens a gate
    tgw_test::gpu_memory(Tensor x, int max_rows) -> Tensor  runs out of GPU memory past max_rows rows

The ops must be registered in every process that scripts, loads or runs a model calling them:
importing this module does that (once per process; a second registration would fail).
"""
from __future__ import annotations

import os
import time

import torch
from torch import Tensor, nn

POISON = 13.0            # the input value CrashOn aborts on
LEAK_BYTES = 1 << 20     # what Leaky leaks per call
LEAKED: list[bytes] = []


@torch.library.custom_op("tgw_test::crash_if", mutates_args=())
def crash_if(x: Tensor, trigger: float) -> Tensor:
    if bool((x == trigger).any()):
        os.abort()  # a native crash: no exception, no Done, the process is gone
    return x.clone()


STICKY_TEXT = ("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be asynchronously "
               "reported at some other API call, so the stacktrace below might be incorrect.")


@torch.library.custom_op("tgw_test::cuda_fault_if", mutates_args=())
def cuda_fault_if(x: Tensor, trigger: float) -> Tensor:
    """Raises what torch raises after an illegal memory access (a sticky CUDA error) on a poison
    input: the CUDA fault path without a GPU. The process goes on; its worker must not."""
    if bool((x == trigger).any()):
        raise RuntimeError(STICKY_TEXT)
    return x.clone()


@torch.library.custom_op("tgw_test::leak", mutates_args=())
def leak(x: Tensor, nbytes: int) -> Tensor:
    LEAKED.append(b"\x01" * nbytes)  # touched pages, so RSS grows too; the line a snapshot names
    return x.clone()


@torch.library.custom_op("tgw_test::wait_gate", mutates_args=())
def wait_gate(x: Tensor, path: str) -> Tensor:
    """With n = x[0, 0] > 0, computes until the file `path.n` exists (60 s at most): a batch the
    test holds in a worker, so queues form behind it for as long as the test needs."""
    n = int(x[0, 0])
    give_up = time.monotonic() + 60
    while n > 0 and not os.path.exists(f"{path}.{n}") and time.monotonic() < give_up:
        time.sleep(0.002)
    return x.clone()


@torch.library.custom_op("tgw_test::gpu_memory", mutates_args=())
def gpu_memory(x: Tensor, max_rows: int) -> Tensor:
    """An allocation that fails as CUDA's caching allocator fails (torch.cuda.OutOfMemoryError,
    its message) when more than max_rows rows come: the out-of-memory path without a GPU."""
    if x.shape[0] > max_rows:
        raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {x.shape[0]} rows of "
                                          f"workspace; the test op holds {max_rows}")
    return x.clone()


class GpuHungry(nn.Module):
    """x float32 [batch, 1] -> 2x; a batch of more than `max_rows` rows runs out of GPU memory."""

    def __init__(self, max_rows: int = 4):
        super().__init__()
        self.max_rows = max_rows

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.tgw_test.gpu_memory(x, self.max_rows) * 2


class Gate(nn.Module):
    """x float32 [batch, 1] -> x; x[0, 0] = n > 0 holds the batch until `path.n` exists."""

    def __init__(self, path: str = "/nonexistent/gate"):
        super().__init__()
        self.path = path

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.tgw_test.wait_gate(x, self.path) + 0


class CrashOn(nn.Module):
    """x float32 [batch, 1] -> x; the worker dies if any element equals `trigger`."""

    def __init__(self, trigger: float = POISON):
        super().__init__()
        self.trigger = trigger

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.tgw_test.crash_if(x, self.trigger) + 0


class FaultOn(nn.Module):
    """x float32 [batch, 1] -> 2x; a simulated sticky CUDA error if any element equals `trigger`."""

    def __init__(self, trigger: float = POISON):
        super().__init__()
        self.trigger = trigger

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.tgw_test.cuda_fault_if(x, self.trigger) * 2


class Leaky(nn.Module):
    """x float32 [batch, 1] -> x; leaks `nbytes` of Python memory per call."""

    def __init__(self, nbytes: int = LEAK_BYTES):
        super().__init__()
        self.nbytes = nbytes

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.tgw_test.leak(x, self.nbytes) + 0


IO = {"inputs": [{"name": "x", "dtype": "float32", "shape": [1]}],
      "outputs": [{"name": "y", "dtype": "float32", "shape": [1]}]}
MODELS = {"crash_on": (CrashOn, IO), "fault_on": (FaultOn, IO), "leaky": (Leaky, IO), "gpu_hungry": (GpuHungry, IO)}


def save(name: str, path: str) -> None:
    torch.jit.script(MODELS[name][0]()).save(path)
