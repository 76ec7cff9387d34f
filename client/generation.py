"""Generation on the native client, the parts both clients share (docs/CLIENT.md, "Generation"):
the request built from `generate`'s arguments, and one sequence's outputs put back in order.

A generation is an `infer` with `generate` set (docs/PROTOCOL.md, "Generation"); one request is
one sequence, so its inputs carry a batch dim of 1: an input given with the rank the model
declares gets it added, one given with it already must have it be 1. Its answers are many
`gen` messages (outputs `first` .. `first + count - 1`, coalesced: one tensor [count, *shape]
per declared output), then one `gen_end` - or an `error`, after any number of outputs.

`Sequence` holds what came for one request, in position order: it never hands out an output
twice or out of order (a message that repeats positions already handed out is cut to the new
ones; one that skips ahead waits for the gap), and at the end it checks that every output the
broker counted arrived. Items are Python ints for a generator whose one output is an integer
scalar (a token), else dicts name -> numpy array of one output.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Any, NamedTuple

import msgspec
import numpy as np

from tgw.shm.errors import Code, TgwError, error_from_body, fail
from tgw.shm.wire import ErrorReply, GenerateEnd, GenerateOutputs, GenerateParams, Sampling

from .tensors import decode_outputs

SAMPLING_FIELDS = tuple(Sampling.__struct_fields__)


class GenerationEnd(NamedTuple):
    """How a generation ended (`final` of a finished stream), as the broker's `gen_end` says."""
    reason: str                 # max_outputs, stop_token, stop_sequence, max_length, done
    outputs: int                # outputs sent, in all
    seed: int | None            # the seed the sampling used (None: greedy, or a generator that samples itself)
    first_output_ms: float      # the broker's receipt -> its first output
    total_ms: float             # the broker's receipt -> the end
    resumed: int                # times the sequence was prefilled again after its worker died
    model: str
    version: str


def generate_params(max_outputs: int | None, sampling: Any, seed: int | None) -> GenerateParams:
    """GenerateParams from generate's arguments: `sampling` None, a dict of Sampling's fields or a
    Sampling; `seed` (optional) is sampling's seed, given on its own. INVALID_ARGUMENT for a bad one."""
    if max_outputs is not None and (isinstance(max_outputs, bool) or not isinstance(max_outputs, int)
                                    or max_outputs < 1):
        raise fail(Code.INVALID_ARGUMENT, f"max_outputs must be a positive int or None, got {max_outputs!r}")
    if sampling is None:
        sampling = Sampling()
    elif isinstance(sampling, dict):
        unknown = sorted(set(sampling) - set(SAMPLING_FIELDS))
        if unknown:
            raise fail(Code.INVALID_ARGUMENT, f"sampling has no field {', '.join(map(repr, unknown))}; its fields "
                       f"are {', '.join(SAMPLING_FIELDS)}")
        try:
            sampling = msgspec.convert(sampling, Sampling)
        except msgspec.ValidationError as exc:
            raise fail(Code.INVALID_ARGUMENT, f"sampling: {exc}") from None
    elif not isinstance(sampling, Sampling):
        raise fail(Code.INVALID_ARGUMENT, "sampling must be None, a dict or a tgw.shm.wire.Sampling, got "
                   f"{type(sampling).__name__}")
    else:
        sampling = msgspec.structs.replace(sampling)   # ours to change (the seed below)
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise fail(Code.INVALID_ARGUMENT, f"seed must be an int or None, got {seed!r}")
        if sampling.seed is not None and sampling.seed != seed:
            raise fail(Code.INVALID_ARGUMENT, f"seed={seed} and sampling's seed {sampling.seed} differ: give one")
        sampling.seed = seed
    check_sampling(sampling)
    return GenerateParams(max_outputs=max_outputs, sampling=sampling)


def check_sampling(s: Sampling) -> None:
    """The ranges a Sampling's fields take (their types msgspec checked)."""
    if not (math.isfinite(s.temperature) and s.temperature >= 0):
        raise fail(Code.INVALID_ARGUMENT, f"sampling temperature must be >= 0 (0: greedy), got {s.temperature}")
    if s.top_k < 0:
        raise fail(Code.INVALID_ARGUMENT, f"sampling top_k must be >= 0 (0: every output), got {s.top_k}")
    if not 0 < s.top_p <= 1:
        raise fail(Code.INVALID_ARGUMENT, f"sampling top_p must be in (0, 1] (1: every output), got {s.top_p}")
    if any(not seq for seq in s.stop_sequences):
        raise fail(Code.INVALID_ARGUMENT, "sampling stop_sequences: each must hold at least one output")


def one_row(inputs: Any, declared: dict[str, int] | None) -> dict[str, Any]:
    """The inputs of one sequence as an infer carries them, a batch dim of 1 leading each.
    `declared`: each input's declared rank (without the batch dim), None when the model is not
    known (the inputs go as given: the broker answers for them). An input whose rank is the
    declared one gets the dim added; one a rank higher must lead with 1. A model with one input
    may be given that input alone, not in a dict."""
    if not isinstance(inputs, dict):
        if declared is None or len(declared) != 1:
            raise fail(Code.INVALID_ARGUMENT, "inputs must be a dict of name -> array" + (
                f" (this model takes {', '.join(declared)})" if declared else ""))
        inputs = {next(iter(declared)): inputs}
    if declared is None:
        return inputs
    out = {}
    for name, value in inputs.items():
        rank = declared.get(name)
        if rank is None:    # not an input of this model: the broker's error names its inputs
            out[name] = value
            continue
        have = rank_of(value)
        if have == rank:
            out[name] = [value] if isinstance(value, (list, tuple, str, bytes)) else _lead(value)
        elif have == rank + 1 and _first_dim(value) == 1:
            out[name] = value
        else:
            raise fail(Code.INVALID_INPUT_SHAPE, f"input {name!r}: a generation is one sequence, so give its "
                       f"{rank}-d value (or that with a leading batch dim of 1); got {have} dims"
                       + (f" leading with {_first_dim(value)}" if have == rank + 1 else ""), input=name)
    return out


def rank_of(value: Any) -> int:
    ndim = getattr(value, "ndim", None)
    if isinstance(ndim, int):
        return ndim
    if isinstance(value, (str, bytes)):
        return 0
    try:
        return np.ndim(value)
    except ValueError:   # ragged nested lists: the broker's decoder will say what is wrong
        return -1


def _first_dim(value: Any) -> int:
    return len(value) if isinstance(value, (list, tuple)) else int(value.shape[0])


def _lead(value: Any) -> Any:
    """value with a leading dim of 1: numpy arrays and torch tensors alike (no torch import)."""
    if isinstance(value, np.ndarray) or hasattr(value, "unsqueeze"):
        return value[None]
    return np.asarray(value)[None]


class Sequence:
    """One generation's outputs as they arrive, handed out in position order; then its end."""

    def __init__(self, req_id: int):
        self.id = req_id
        self.items: deque = deque()   # outputs ready to hand out, in order
        self.next = 0                 # position of the next output to queue in `items`
        self._held: dict[int, list] = {}   # first -> items of a message that came before a gap
        self.scalar: bool | None = None    # items are ints (one integer scalar output); None: nothing yet
        self.final: GenerationEnd | None = None
        self.error: BaseException | None = None
        self.answered = False   # the broker ended it (gen_end or error): nothing more comes for it

    @property
    def ended(self) -> bool:
        """Nothing more will come (the end, an error, or a lost connection)."""
        return self.final is not None or self.error is not None

    def feed(self, reply, parts: list) -> None:
        """One message for this sequence: `gen`, `gen_end` or `error` (others: an INTERNAL error)."""
        if self.ended:
            return
        if type(reply) is GenerateOutputs:
            self._outputs(reply, parts)
        elif type(reply) is GenerateEnd:
            self.answered = True
            self._end(reply)
        elif type(reply) is ErrorReply:
            self.answered = True
            self.error = error_from_body(reply.error)
        else:
            self.error = fail(Code.INTERNAL, f"a generation's request was answered by a {type(reply).__name__} "
                              "(is the broker older than generation?)", request_id=self.id, source="client")

    def fail(self, error: BaseException) -> None:
        if not self.ended:
            self.error = error

    def take(self):
        """(True, the next output), or (False, None) when none is ready and the stream goes on.
        Raises StopIteration once every output was taken after the end, or the error."""
        if self.items:
            return True, self.items.popleft()
        if self.error is not None:
            raise self.error
        if self.final is not None:
            raise StopIteration
        return False, None

    def _outputs(self, msg: GenerateOutputs, parts: list) -> None:
        try:
            arrays = decode_outputs(msg.outputs, parts)
        except TgwError as err:
            self.error = err
            return
        if any(a.shape[:1] != (msg.count,) for a in arrays.values()):
            self.error = fail(Code.INTERNAL, f"a gen message of {msg.count} outputs carried tensors shaped "
                              f"{[list(a.shape) for a in arrays.values()]}", request_id=self.id, source="client")
            return
        if self.scalar is None:
            self.scalar = len(arrays) == 1 and all(a.ndim == 1 and a.dtype.kind in "iu" for a in arrays.values())
        if self.scalar:
            items = next(iter(arrays.values())).tolist()
        else:
            items = [{k: a[i] for k, a in arrays.items()} for i in range(msg.count)]
        self._held[msg.first] = items
        self._release()

    def _release(self) -> None:
        """Queue the held messages that continue the sequence (repeated positions cut off)."""
        while True:
            start = next((f for f in self._held if f <= self.next), None)
            if start is None:
                return
            items = self._held.pop(start)
            fresh = items[self.next - start:]
            self.items.extend(fresh)
            self.next += len(fresh)

    def _end(self, msg: GenerateEnd) -> None:
        if self.next < msg.outputs:
            self.error = fail(Code.UNAVAILABLE, f"the generation ended after {msg.outputs} outputs but only "
                              f"{self.next} arrived in order (outputs were lost on the way: was the caller "
                              "reading too slowly?)", request_id=self.id, source="client", received=self.next,
                              sent=msg.outputs)
            return
        self.final = GenerationEnd(msg.reason, msg.outputs, msg.seed, msg.first_output_ms, msg.total_ms,
                                   msg.resumed, msg.model, msg.version)
