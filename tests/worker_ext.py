"""A preload module for tests (`tgw-worker --preload worker_ext` or `--preload /path/to/worker_ext.py`):
registers two custom ops, callable from TorchScript, that stand in for a deployment's native ops.

    tgw_test::crash_if(Tensor x, float trigger) -> Tensor   aborts the process on a poison input
    tgw_test::leak(Tensor x, int nbytes) -> Tensor          leaks nbytes per call

The ops must be registered in every process that scripts, loads or runs a model calling them:
importing this module does that (once per process; a second registration would fail).
"""
from __future__ import annotations

import os

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


@torch.library.custom_op("tgw_test::leak", mutates_args=())
def leak(x: Tensor, nbytes: int) -> Tensor:
    LEAKED.append(b"\x01" * nbytes)  # touched pages, so RSS grows too; the line a snapshot names
    return x.clone()


class CrashOn(nn.Module):
    """x float32 [batch, 1] -> x; the worker dies if any element equals `trigger`."""

    def __init__(self, trigger: float = POISON):
        super().__init__()
        self.trigger = trigger

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.tgw_test.crash_if(x, self.trigger) + 0


class Leaky(nn.Module):
    """x float32 [batch, 1] -> x; leaks `nbytes` of Python memory per call."""

    def __init__(self, nbytes: int = LEAK_BYTES):
        super().__init__()
        self.nbytes = nbytes

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.tgw_test.leak(x, self.nbytes) + 0


IO = {"inputs": [{"name": "x", "dtype": "float32", "shape": [1]}],
      "outputs": [{"name": "y", "dtype": "float32", "shape": [1]}]}
MODELS = {"crash_on": (CrashOn, IO), "leaky": (Leaky, IO)}


def save(name: str, path: str) -> None:
    torch.jit.script(MODELS[name][0]()).save(path)
