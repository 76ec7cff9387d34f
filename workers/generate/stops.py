"""Why a sequence ends after an output (docs/GENERATION.md "The step loop"), decided on the worker
as each output is picked, in this order:

* stop_token: the output is one of the model's end_tokens or the request's stop_tokens; it is
  NOT emitted;
* error: the handler failed the row (batch.fail) or its logits had no valid value;
* then the output is emitted, and the sequence ends after it with stop_sequence (its outputs now
  end with one of the request's stop_sequences), done (the handler said so), max_outputs (the
  request's count reached), or max_length (the next position would not fit: a step writes the
  last output at position prompt length + outputs before it, which must stay below max_length).

Tokens (stop tokens and stop sequences) apply to generators whose one declared output is an
integer scalar; the outputs a resumed sequence already delivered count towards its stop
sequences, as if they had been generated here.
"""
from __future__ import annotations

from collections import deque
from typing import Iterable, Optional

STOP_TOKEN, STOP_SEQUENCE, DONE, MAX_OUTPUTS, MAX_LENGTH, ERROR, CANCELLED = (
    "stop_token", "stop_sequence", "done", "max_outputs", "max_length", "error", "cancelled")


class Stops:
    """One sequence's stop tokens and stop sequences, with the tail of its outputs they need."""

    def __init__(self, tokens: Iterable[int], sequences: Iterable[Iterable[int]], history: Iterable[int] = ()):
        self.tokens = frozenset(int(t) for t in tokens)
        self.sequences = [tuple(int(t) for t in s) for s in sequences if len(s)]
        longest = max((len(s) for s in self.sequences), default=0)
        self.tail: deque[int] = deque(history, maxlen=longest) if longest else deque(maxlen=0)

    def is_stop_token(self, value: int) -> bool:
        return value in self.tokens

    def emitted(self, value: int) -> bool:
        """Note an emitted output; whether the outputs now end with a stop sequence."""
        if not self.sequences:
            return False
        self.tail.append(value)
        return self.ended()

    def ended(self) -> bool:
        """Whether the outputs so far end with a stop sequence (a resumed sequence's delivered
        ones may: its worker died after the stop, before the broker heard of its end)."""
        tail = tuple(self.tail)
        return any(tail[len(tail) - len(s):] == s for s in self.sequences if len(s) <= len(tail))


def after_emit(stop_sequence: bool, done: bool, outputs: int, max_outputs: int, next_position: int,
               max_length: int) -> Optional[str]:
    """The reason a sequence ends after an emitted output (None: it goes on). `outputs`: its
    outputs so far, this one included; `next_position`: where its next step would write."""
    if stop_sequence:
        return STOP_SEQUENCE
    if done:
        return DONE
    if outputs >= max_outputs:
        return MAX_OUTPUTS
    if max_length and next_position >= max_length:
        return MAX_LENGTH
    return None
