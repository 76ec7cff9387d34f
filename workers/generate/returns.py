"""What a generator's prefill or step returned, checked against its declaration on every call
(docs/GENERATION.md "The contract") and brought to the host once.

A dict with either `logits` (a floating tensor [rows, vocab]: the worker samples each row's
output; the one declared output must then be an integer scalar) or every declared output by name
([rows, *declared shape], the declared dtype); optionally `done` (bool [rows]) and, from prefill,
`lengths` (integer [rows], each >= 1: the positions each prompt took). Anything else - a missing
or extra key, a wrong dtype or shape - is a ReturnError naming what was wrong.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from tgw.shm.wire import IOSpec

from ..runner import TORCH_DTYPES

LOGITS, DONE, LENGTHS = "logits", "done", "lengths"
INTEGER_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")


class ReturnError(ValueError):
    """A prefill or step whose return breaks the contract or the declared outputs."""


@dataclass
class Returned:
    rows: int
    logits: Optional[torch.Tensor] = None             # [rows, vocab] float64 on the CPU, when sampled
    values: Optional[dict[str, torch.Tensor]] = None  # name -> [rows, *shape] on the CPU, when not sampled
    done: Optional[list[bool]] = None
    lengths: Optional[list[int]] = None


def sampleable(outputs: list[IOSpec]) -> bool:
    """Whether a generator with these outputs may return logits: one integer scalar output."""
    return len(outputs) == 1 and outputs[0].dtype in INTEGER_DTYPES and not outputs[0].shape


def checked(result: Any, rows: int, outputs: list[IOSpec], phase: str) -> Returned:
    """`result` of `phase` ("prefill" or "step") for `rows` rows, checked and on the host."""
    if not isinstance(result, dict):
        raise ReturnError(f"{phase} returned {type(result).__name__}, not a dict of tensors")
    names = [t.name for t in outputs]
    sampled = LOGITS in result and LOGITS not in names
    allowed = {DONE} | ({LENGTHS} if phase == "prefill" else set()) | ({LOGITS} if sampled else set(names))
    extra = sorted(str(k) for k in result if k not in allowed)
    if extra:
        raise ReturnError(f"{phase} returned keys {extra} it may not: the keys are "
                          f"{'logits' if sampled else ', '.join(names)}, done" +
                          (", lengths" if phase == "prefill" else ""))
    out = Returned(rows)
    if sampled:
        if not sampleable(outputs):
            raise ReturnError(f"{phase} returned logits, but the worker samples only a generator whose one output is "
                              f"an integer scalar; the outputs are {[(t.name, t.dtype, t.shape) for t in outputs]}: "
                              "return them by name")
        logits = _tensor(result[LOGITS], LOGITS, phase)
        if not logits.is_floating_point() or logits.dim() != 2 or logits.shape[0] != rows or logits.shape[1] < 1:
            raise ReturnError(f"{phase} returned logits {logits.dtype} {list(logits.shape)}; expected a floating "
                              f"tensor [{rows}, vocab]")
        out.logits = logits.detach().to("cpu", torch.float64)
    else:
        missing = [n for n in names if n not in result]
        if missing:
            raise ReturnError(f"{phase} returned no {missing} (nor logits); the declared outputs are {names}")
        out.values = {}
        for t in outputs:
            value = _tensor(result[t.name], t.name, phase)
            want = [rows, *t.shape]
            if value.dtype != TORCH_DTYPES[t.dtype] or list(value.shape) != want:
                raise ReturnError(f"{phase} returned {t.name!r} {str(value.dtype).removeprefix('torch.')} "
                                  f"{list(value.shape)}; declared {t.dtype} {want}")
            out.values[t.name] = value.detach().to("cpu").contiguous()
    if result.get(DONE) is not None:
        done = _tensor(result[DONE], DONE, phase)
        if done.dtype != torch.bool or list(done.shape) != [rows]:
            raise ReturnError(f"{phase} returned done {done.dtype} {list(done.shape)}; expected bool [{rows}]")
        out.done = done.tolist()
    if result.get(LENGTHS) is not None:
        lengths = _tensor(result[LENGTHS], LENGTHS, phase)
        if lengths.is_floating_point() or lengths.dtype == torch.bool or list(lengths.shape) != [rows]:
            raise ReturnError(f"{phase} returned lengths {lengths.dtype} {list(lengths.shape)}; expected an integer "
                              f"tensor [{rows}]")
        out.lengths = [int(n) for n in lengths.tolist()]
        if any(n < 1 for n in out.lengths):
            raise ReturnError(f"{phase} returned lengths {out.lengths}: a prompt takes at least one position")
    return out


def _tensor(value: Any, name: str, phase: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ReturnError(f"{phase} returned {name!r} as {type(value).__name__}, not a torch tensor")
    return value
