"""The stage contract: a Python class a worker serves like a model (docs/STAGES.md).

A stage receives one batch - fixed-dtype inputs as torch tensors of [rows, *dims], `bytes`
inputs as Python lists of `rows` items - and returns every declared output. It may fail single
rows (`batch.fail(row, message)`): their requests are answered INVALID_ARGUMENT with the
message, the other requests of the batch are served. Subclassing `Stage` is optional: any class
with `__call__(batch)` (and, if it wants them, `setup(context)` and `warmup()`) will do.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class StageContext:
    """What `setup(context)` is told, once per worker process."""
    name: str                  # the model entry's name in the config
    version: str
    dir: str                   # the handler file's folder (files next to it); "" for a module handler
    device: torch.device       # where the stage runs: cpu, or the worker's GPU for `device: cuda`
    threads: int               # torch's intra-op threads in this worker
    options: dict[str, Any] = field(default_factory=dict)   # the config's `options:` for this stage
    # False for max_batch_size 0: batch tensors come without the batch dim (one request a batch)
    batched: bool = True


class StageBatch:
    """One batch as a stage sees it: `batch["name"]` for an input, `batch.rows`, `batch.device`,
    `batch.fail(row, message)`."""

    def __init__(self, rows: int, device: torch.device, inputs: dict[str, Any], starts: list[int] | None = None,
                 ids: list[int] | None = None):
        self.rows, self.device, self.inputs = rows, device, inputs
        # where each request's rows begin, and the end (None: not told, e.g. a warm-up example);
        # each request's id as its caller sent it. Read by adapters that answer per request.
        self.starts, self.ids = starts, list(ids or [])
        self.failed: dict[int, str] = {}    # row -> message, in the order the stage failed them

    def __getitem__(self, name: str) -> Any:
        try:
            return self.inputs[name]
        except KeyError:
            raise KeyError(f"this stage has no input {name!r}; its inputs are {sorted(self.inputs)}") from None

    def __contains__(self, name: str) -> bool:
        return name in self.inputs

    def __len__(self) -> int:
        return self.rows

    def fail(self, row: int, message: str) -> None:
        """Fail one row: its request is answered INVALID_ARGUMENT with `message`. The outputs
        returned must still have all rows (a failed row's values are ignored)."""
        self.fail_as(row, str(message))

    def fail_as(self, row: int, failure: str) -> None:
        """Fail one row with a RowFailure (its own code and wording) or a message."""
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < self.rows:
            raise IndexError(f"batch.fail: row {row!r} is not a row of this {self.rows}-row batch")
        self.failed.setdefault(row, failure)


class RowFailure(str):
    """A row's message answered with `code` and as it is (no "stage NAME:" in front): an adapter
    that speaks another server's errors (a Triton Python model's TritonError) fails rows so."""

    def __new__(cls, message: str, code: str):
        failure = super().__new__(cls, message)
        failure.code = code
        return failure


class Stage:
    """A base class with the optional hooks' defaults; subclasses implement `__call__`."""

    def setup(self, context: StageContext) -> None:
        """Once per worker process, before warm-up: open files, build tables, pick the device."""

    def warmup(self) -> None:
        """Once after setup (default: nothing)."""

    def __call__(self, batch: StageBatch) -> dict:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(batch)")
