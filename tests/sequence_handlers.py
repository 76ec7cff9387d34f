"""Sequence-model handler classes and TorchScript modules for the tests (tests/inproc/
test_sequence_loop.py): loaded by file path as a worker loads a handler, or scripted to a file."""
from __future__ import annotations

import torch
from torch import nn


class Counter:
    """Counts its sequence's steps in state `n` and fails a row whose x is negative."""

    def step(self, batch):
        n = batch.state["n"]
        n[batch.slots] += 1
        for row in range(batch.rows):
            if batch["x"][row, 0] < 0:
                batch.fail(row, "x must not be negative")
        return {"steps": n[batch.slots].clone(), "corrid": torch.tensor([[c] for c in batch.corrids])}


class RaisingStep:
    def step(self, batch):
        raise RuntimeError("no state today")


class NoStep:
    def __call__(self, batch):
        return {}


class Indexed(nn.Module):
    """Triton's NAMED_INDEX convention: fed in the order of the names' __<index>, not the config's;
    returns its corrid control and its state (steps counted by the READY control) by index too."""

    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor):
        return d + c, b   # S_NEXT__0, then OUT__1: (x, corrid, ready, state) by index


class OneOutput(nn.Module):
    """Forgets to return its state's next value."""

    def forward(self, INPUT: torch.Tensor, INPUT_STATE: torch.Tensor) -> torch.Tensor:  # noqa: N803
        return INPUT + INPUT_STATE


def script(module: nn.Module, path: str) -> str:
    torch.jit.save(torch.jit.script(module.eval()), path)
    return path


class WrongState(nn.Module):
    """Returns its state's next value as float64 where int32 is declared."""

    def forward(self, INPUT: torch.Tensor, INPUT_STATE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: N803
        total = INPUT + INPUT_STATE
        return total, total.double()
