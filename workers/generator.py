"""The generator contract: a Python class whose requests answer many times (docs/GENERATION.md).

Its worker owns the loop, the state and the scheduling; the class brings the model:

* `setup(context)` once per worker process (a StageContext, as a stage's: name, version, dir,
  device, threads, options): load weights, build the module;
* `prefill(batch)` for new sequences (a PrefillBatch): read each row's inputs, write the row's
  state into its slot, return each row's first output;
* `step(batch)` for the running ones (a StepBatch): read each row's last output and its slot,
  update the slot, return each row's next output.

Both return a dict: either `logits` (a float tensor [rows, vocab]: the worker picks each output
by the request's sampling, for a generator whose one declared output is an integer scalar, e.g. a
token), or every declared output by name ([rows, *declared shape]); and optionally `done` (bool
[rows]: the row's sequence ends after this output). prefill may also return `lengths` (long
[rows]: the positions each prompt took, e.g. its token count when it tokenizes text itself; by
default the element count of the config's `generator.length_input`). A row may also be failed on its own
(`batch.fail(row, message)`): its sequence ends with that message, the others go on.

State: per sequence, the tensors the config's `generator.state` declares. The worker allocates
each once at load as a pool [slots, *shape] on the model's device (`batch.state[name]`); a row's
slot is `batch.slots[row]`. The handler reads and writes its rows' slots and never allocates per
sequence. A slot is not cleared when it is reused: prefill must write all the state it reads.
"""
from __future__ import annotations

from typing import Any

import torch

from .stage import StageContext  # noqa: F401 - setup(context) gets a stage's context


class _Rows:
    """What both batches share: rows, device, slots, the state pools, per-row failures."""

    def __init__(self, rows: int, device: torch.device, slots: torch.Tensor, state: dict[str, torch.Tensor]):
        self.rows, self.device, self.slots, self.state = rows, device, slots, state
        self.failed: dict[int, str] = {}   # row -> message, in the order the handler failed them

    # batch[name]: the mapping a subclass names (_named) and what its keys are (_what), for the error
    _named, _what = "inputs", "input"

    def __getitem__(self, name: str):
        named = getattr(self, self._named)
        try:
            return named[name]
        except KeyError:
            raise KeyError(f"this generator has no {self._what} {name!r}; its {self._what}s are {sorted(named)}") \
                from None

    def __contains__(self, name: str) -> bool:
        return name in getattr(self, self._named)

    def __len__(self) -> int:
        return self.rows

    def fail(self, row: int, message: str) -> None:
        """End one row's sequence with `message` (INVALID_ARGUMENT); return its output anyway
        (any value: it is not sent)."""
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < self.rows:
            raise IndexError(f"batch.fail: row {row!r} is not a row of this {self.rows}-row batch")
        self.failed.setdefault(row, str(message))


class PrefillBatch(_Rows):
    """New sequences: `batch[name]` is a list of each row's input tensor (on `batch.device`, its
    own shape: prompts differ in length; a `bytes` input's row is its bytes, or nested lists of
    them by its shape, as a stage gets); `batch.prefix[name]` a list of each row's outputs
    already delivered ([n, *shape]; n = 0 but for a sequence resumed after its worker died, which
    must continue as if those outputs had been generated: append them to the prompt); `slots` a
    long tensor [rows] of each row's slot; `state` name -> the whole pool [slots, *shape]."""

    def __init__(self, rows: int, device: torch.device, slots: torch.Tensor, state: dict[str, torch.Tensor],
                 inputs: dict[str, list[torch.Tensor]], prefix: dict[str, list[torch.Tensor]]):
        super().__init__(rows, device, slots, state)
        self.inputs, self.prefix = inputs, prefix


class StepBatch(_Rows):
    """Running sequences: `batch[name]` is each row's last output of the declared output `name`
    ([rows, *shape], on `batch.device`); `positions` a long tensor [rows]: where in the sequence
    that last output sits (prompt length + outputs before it: a KV cache writes there); `slots`
    and `state` as in a PrefillBatch."""

    def __init__(self, rows: int, device: torch.device, slots: torch.Tensor, state: dict[str, torch.Tensor],
                 last: dict[str, torch.Tensor], positions: torch.Tensor):
        super().__init__(rows, device, slots, state)
        self.last, self.positions = last, positions

    _named, _what = "last", "output"


class Generator:
    """A base class with the contract's docstrings; subclassing it is optional (any class with
    prefill and step will do)."""

    def setup(self, context: StageContext) -> None:
        """Once per worker process: load or build the model on context.device."""

    def prefill(self, batch: PrefillBatch) -> dict[str, Any]:
        raise NotImplementedError(f"{type(self).__name__} must implement prefill(batch)")

    def step(self, batch: StepBatch) -> dict[str, Any]:
        raise NotImplementedError(f"{type(self).__name__} must implement step(batch)")
