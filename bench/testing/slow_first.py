"""A model slow on its first call per (batch rows, shape) in each process and version: what a
TorchScript model under the profiling executor, a kernel autotuner or lazy allocations do, made
deterministic. Its forward calls a custom op that sleeps `ms` the first time it sees a shape
under the model's tag (each saved file has its own), and says so on stderr (FIRST_CALL: which
thread paid it - a worker's loader thread, or its serving loop). For the warm-up tests (and the
retired warm-up benchmark, bench/results/RETIRED.md); a worker preloads it as
`tgw.testing.slow_first` (workers.preload).

    tgw_testing::first_call_sleep(Tensor x, str tag, float ms) -> Tensor

Importing the module registers the op (once per process; a second registration would fail).
"""
from __future__ import annotations

import sys
import threading
import time
from collections import Counter

import torch
from torch import Tensor, nn

CALLS: Counter = Counter()   # (tag, shape with the batch dim) -> calls in this process
_calls_lock = threading.Lock()   # the serving loop and the loader thread may call at once
FIRST_CALL = "slow_first: first call"   # then tag=..., shape=..., thread=...
IO = {"inputs": [{"name": "x", "dtype": "float32", "shape": [-1]}],
      "outputs": [{"name": "y", "dtype": "float32", "shape": [-1]}]}


@torch.library.custom_op("tgw_testing::first_call_sleep", mutates_args=())
def first_call_sleep(x: Tensor, tag: str, ms: float) -> Tensor:
    key = (tag, tuple(x.shape))
    with _calls_lock:
        CALLS[key] += 1
        first = CALLS[key] == 1
    if first:
        print(f"{FIRST_CALL} tag={tag} shape={','.join(map(str, x.shape))} thread={threading.current_thread().name}",
              file=sys.stderr, flush=True)
        time.sleep(ms / 1000)
    return x.clone()


class SlowFirst(nn.Module):
    """x float32 [batch, -1] -> 2x + k; its first call at each shape sleeps `ms`; `pad_floats`
    zeros it carries make it large (4 bytes each)."""

    def __init__(self, k: float, tag: str, ms: float, pad_floats: int = 1):
        super().__init__()
        self.k, self.tag, self.ms = k, tag, ms
        self.register_buffer("pad", torch.zeros(max(1, pad_floats)))

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.tgw_testing.first_call_sleep(x, self.tag, self.ms) * 2 + self.k + self.pad[:1]


def save_slow_first(path: str, k: float, ms: float = 200.0, pad_floats: int = 1) -> str:
    """A TorchScript SlowFirst file; its tag is its path, so each file is cold in a new process."""
    torch.jit.save(torch.jit.script(SlowFirst(float(k), path, float(ms), pad_floats)), path)
    return path


def first_calls(log: str, tag: str) -> list[tuple[str, str]]:
    """(shape, thread) of each first call of the model saved at `tag` that a log shows."""
    out = []
    for line in log.splitlines():
        if line.startswith(FIRST_CALL) and f" tag={tag} " in line:
            fields = dict(part.split("=", 1) for part in line[len(FIRST_CALL):].split())
            out.append((fields["shape"], fields["thread"]))
    return out


def calls(tag: str) -> dict[tuple, int]:
    """This process's calls of the model saved at `tag` (its path), by input shape."""
    with _calls_lock:
        return {shape: n for (t, shape), n in CALLS.items() if t == tag}
