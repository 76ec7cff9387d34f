"""A generator's admission batch taken in (docs/GENERATION.md "The step loop"): each request of
the ring's batch becomes a Sequence whose inputs are copied out (the ring block is released once
the batch is answered, before the sequence is prefilled), with its resumed outputs decoded and
its request checked. A request the worker cannot run is refused with the reason, not run.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from tgw.shm.errors import Code
from tgw.shm.wire import GenSeq

from ..runner import TORCH_DTYPES
from .runner import prompt_length
from .sequence import Sequence
from .stops import Stops


class Refused(ValueError):
    """A request the loop will not run: its sequence ends with `code` and the message."""

    def __init__(self, code: Code, message: str):
        super().__init__(message)
        self.code = code


def sequence(runner, gs: GenSeq, request_id: int, rows: int, row: dict[str, Any], tokens: bool) -> Sequence:
    """The Sequence of one request whose input rows are `row` (name -> its row: a ring view of a
    fixed-dtype input, copied here to the generator's device; a bytes input's nested list)."""
    label = runner.label
    if rows != 1:
        raise Refused(Code.INVALID_ARGUMENT, f"{label}: a generation is one row (one prompt); this request has {rows}")
    s = gs.sampling
    if not (s.temperature >= 0 and math.isfinite(s.temperature)) or s.top_k < 0 or not 0 < s.top_p <= 1:
        raise Refused(Code.INVALID_ARGUMENT, f"{label}: sampling needs temperature >= 0, top_k >= 0 and 0 < top_p <= 1;"
                      f" got temperature {s.temperature}, top_k {s.top_k}, top_p {s.top_p}")
    if not tokens and (s.stop_tokens or any(s.stop_sequences)):
        raise Refused(Code.INVALID_ARGUMENT, f"{label}: stop_tokens and stop_sequences need a generator whose one "
                      "output is an integer scalar (a token)")
    max_outputs = gs.max_outputs or runner.gen.max_outputs
    if gs.delivered < 0 or max_outputs < 1:
        raise Refused(Code.INVALID_ARGUMENT, f"{label}: max_outputs {max_outputs} and delivered {gs.delivered} "
                      "must be >= 1 and >= 0")
    prefix = _prefix(runner, gs)
    history = prefix[runner.outputs[0].name].flatten().tolist() if tokens and gs.delivered else []
    stops = Stops([*runner.gen.end_tokens, *s.stop_tokens], s.stop_sequences, history) if tokens else Stops((), ())
    length = prompt_length(row[runner.length_input])
    if length < 1:
        raise Refused(Code.INVALID_ARGUMENT, f"{label}: the prompt ({runner.length_input!r}) is empty; a generation "
                      "starts from at least one position")
    device = runner.device
    inputs = {name: (x.to(device, copy=True) if isinstance(x, torch.Tensor) else x) for name, x in row.items()}
    return Sequence(gs, request_id, inputs, prefix, max_outputs, stops, length)


def _prefix(runner, gs: GenSeq) -> dict[str, torch.Tensor]:
    """Each declared output's delivered values [delivered, *shape] on the generator's device."""
    outputs, n = runner.outputs, gs.delivered
    if n and len(gs.prefix) != len(outputs):
        raise Refused(Code.INVALID_ARGUMENT, f"{runner.label}: a resumed sequence carries {len(gs.prefix)} prefix "
                      f"tensor(s) for {len(outputs)} declared output(s)")
    out = {}
    for k, t in enumerate(outputs):
        dtype = TORCH_DTYPES[t.dtype]
        if not n:
            out[t.name] = torch.zeros([0, *t.shape], dtype=dtype, device=runner.device)
            continue
        data = gs.prefix[k]
        want = n * math.prod(t.shape) * dtype.itemsize
        if len(data) != want:
            raise Refused(Code.INVALID_ARGUMENT, f"{runner.label}: the prefix of {t.name!r} is {len(data)} bytes; "
                          f"{n} delivered output(s) of {t.dtype} {t.shape} are {want}")
        value = torch.frombuffer(bytearray(data), dtype=dtype).reshape([n, *t.shape])
        out[t.name] = value.to(runner.device)
    return out
