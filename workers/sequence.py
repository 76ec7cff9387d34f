"""The sequence model contract for a handler class (docs/SEQUENCES-MODEL.md): Triton's sequence
batching, with the state kept by the worker.

A sequence model's version that names a `handler:` is a class with `step(batch)` (and, if it wants
them, `setup(context)` and `warmup()`, as a stage's). Each call gets one SequenceBatch: one row per
request, each the next step of a different sequence, in the slots the broker bound them to. The
worker allocates every declared state tensor once, at load, as a pool [slots, *shape] on the
model's device, and sets a slot to its `initial` value before a batch whose row starts a sequence
there; the handler reads and writes its rows, `batch.state[name][batch.slots]`, and returns every
declared output ([rows, *shape]) as a stage does. An exception fails the batch; `batch.fail(row,
message)` fails one request (its state writes are the handler's to skip).

    class RunningMean:
        def step(self, batch):
            total = batch.state["total"]                      # [slots, 1] float32, 0 at a start
            count = batch.state["count"]
            total[batch.slots] += batch["x"]                  # this batch's rows only
            count[batch.slots] += 1
            return {"mean": total[batch.slots] / count[batch.slots]}
"""
from __future__ import annotations

from typing import Any

import torch

from .stage import StageBatch


class SequenceBatch(StageBatch):
    """One batch of sequence steps as a handler sees it: `batch["name"]` / `batch.inputs` (the
    requests' tensors, [rows, ...]; bytes inputs as lists), `batch.rows`, `batch.device`,
    `batch.slots` (long [rows]: each row's state slot), `batch.start` and `batch.end` (bool
    [rows]: the row starts / ends its sequence), `batch.corrids` (each row's correlation id, an
    int or a str), `batch.state` (name -> the whole pool [slots, *shape]) and `batch.fail(row,
    message)`."""

    def __init__(self, rows: int, device: torch.device, inputs: dict[str, Any], slots: torch.Tensor,
                 start: torch.Tensor, end: torch.Tensor, corrids: list, state: dict[str, torch.Tensor]):
        super().__init__(rows, device, inputs)
        self.slots, self.start, self.end, self.corrids, self.state = slots, start, end, corrids, state


class SequenceModel:
    """A base class with the optional hooks' defaults; subclasses implement `step`."""

    def setup(self, context) -> None:
        """Once per worker process, before warm-up (a StageContext, as a stage's)."""

    def warmup(self) -> None:
        """Once after setup (default: nothing)."""

    def step(self, batch: SequenceBatch) -> dict:
        raise NotImplementedError(f"{type(self).__name__} must implement step(batch)")
