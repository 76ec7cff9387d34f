"""A state slot pool, shared by generators (generate/runner.py) and sequence models
(sequence_runner.py): per declared state tensor, [slots, *shape] on the model's device,
allocated once at load and never again.

Slots are `max_sequences`, or as many as `state_memory` bytes hold (at most MAX_SLOTS); none is a
load failure that gives the arithmetic. The pool's bytes count in the runner's `nbytes` (a floor
of its measured footprint), so the broker's residency counts them.
"""
from __future__ import annotations

import math

import torch

from .runner import TORCH_DTYPES

MAX_SLOTS = 65536   # as the config's max_sequences allows


class PoolSizeError(ValueError):
    """A slot pool that cannot be sized or made."""


def slot_bytes(state: list) -> tuple[int, str]:
    """One sequence's state bytes (`state`: the spec's state tensors), and how they add up."""
    parts, total = [], 0
    for s in state:
        if s.dtype not in TORCH_DTYPES:
            raise PoolSizeError(f"state {s.name!r}: dtype {s.dtype!r} is not one of {', '.join(TORCH_DTYPES)}")
        n = math.prod(s.shape) * TORCH_DTYPES[s.dtype].itemsize
        parts.append(f"{s.name} {s.dtype} {list(s.shape)} = {n:,} bytes")
        total += n
    return total, "; ".join(parts)


def pool_slots(decl, what: str = "a generator") -> int:
    """Slots of `decl` (a GeneratorSpec or SequenceSpec): max_sequences, else what state_memory
    holds (capped at MAX_SLOTS)."""
    per, how = slot_bytes(decl.state)
    if decl.max_sequences > 0:
        return decl.max_sequences
    if per == 0:
        raise PoolSizeError(f"{what} sized by state_memory needs state of at least one byte a sequence")
    slots = min(decl.state_memory // per, MAX_SLOTS)
    if slots < 1:
        raise PoolSizeError(f"state_memory of {decl.state_memory:,} bytes holds 0 slots: one sequence's state is "
                            f"{per:,} bytes ({how}); raise state_memory_mb to at least "
                            f"{math.ceil(per / (1 << 20) * 100) / 100} or shrink the state")
    return slots


def new_pool(state: list, slots: int, device: torch.device) -> dict[str, torch.Tensor]:
    """name -> [slots, *shape] of each state tensor, filled with its `initial` (0 when it has none)."""
    return {s.name: torch.full([slots, *s.shape], getattr(s, "initial", 0.0), dtype=TORCH_DTYPES[s.dtype],
                               device=device) for s in state}
