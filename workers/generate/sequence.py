"""One sequence in a generator's step loop: what the broker asked (its GenSeq), its inputs copied
out of the ring, its slot, and how far it has come.

Positions: a prompt takes positions 0 .. prompt_len - 1; output n sits at prompt_len + n. A step
reads a row's last output (output `produced - 1`) at its position and writes its state there, and
returns output `produced`. A resumed sequence (its worker died) arrives with `delivered` outputs
already sent: its prefill takes them appended to the prompt and returns output `delivered`.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from tgw.shm.wire import GenSeq

from .stops import Stops


class Sequence:
    __slots__ = ("seq", "request_id", "slot", "inputs", "prefix", "delivered", "max_outputs", "temperature", "top_k",
                 "top_p", "seed", "stops", "prompt_len", "produced")

    def __init__(self, gs: GenSeq, request_id: int, inputs: dict[str, Any], prefix: dict[str, torch.Tensor],
                 max_outputs: int, stops: Stops, prompt_len: Optional[int]):
        self.seq, self.request_id = gs.seq, request_id
        self.slot = -1                       # its state slot, once the loop admits it
        self.inputs, self.prefix = inputs, prefix   # the prompt's rows; each output's [delivered, *shape]
        self.delivered = gs.delivered
        self.max_outputs = max_outputs
        s = gs.sampling
        self.temperature, self.top_k, self.top_p = s.temperature, s.top_k, s.top_p
        self.seed = s.seed if s.seed is not None else 0   # the broker draws seeds; None only from a bare caller
        self.stops = stops
        self.prompt_len = prompt_len         # None until prefill says (a handler that returns `lengths`)
        self.produced = gs.delivered         # outputs so far: the next output's index

    @property
    def position(self) -> int:
        """Where its last output sits: a step writes its state there."""
        return self.prompt_len + self.produced - 1

    def release_inputs(self) -> None:
        """After prefill: the prompt is in the slot, its copies are not needed."""
        self.inputs, self.prefix = {}, {}
