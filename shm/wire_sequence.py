"""The wire contract of Triton-style sequence batching: client-driven steps of a stateful model
(docs/SEQUENCES.md, docs/PROTOCOL.md "Sequences").

Imported through tgw.shm.wire like every other message.

A sequence model keeps state per sequence between requests that the caller sends one at a
time (streaming audio, an RNN, an accumulator). Each request is an ordinary `infer` whose
`sequence` field names its correlation id (uint64 or string, as Triton allows) and carries the
start and end flags. The broker binds a sequence, at its start, to one worker and one state slot
of that worker's pool (allocated once at load, as a generator's: ModelLoaded.slots); every later
request of the sequence goes to that worker, in order, at most one per batch, and names the slot
in `Batch.steps`. Requests of different sequences batch together. The slot is freed when the
request with the end flag is answered, or after the model's idle timeout; the broker is the one
writer of which sequence holds which slot.

The worker feeds the model as Triton does: a handler class gets the slots, the flags and the
state pools (workers/sequence.py); a file model written for Triton's PyTorch backend gets its
control inputs (START, END, READY, CORRID) and its implicit state as extra inputs, and its state
outputs are written back to the slots (never sent to the caller).
"""
from __future__ import annotations

from typing import Optional, Union

from .wire_base import Struct

CorrId = Union[int, str]   # Triton's correlation id: a uint64 (non-zero) or a string (non-empty)

# control kinds (Triton's CONTROL_SEQUENCE_START, _END, _READY, _CORRID)
START, END, READY, CORRID = "start", "end", "ready", "corrid"
CONTROL_KINDS = (START, END, READY, CORRID)


# ---- caller -> broker (inside Infer.sequence) -------------------------------------------------


class SequenceRef(Struct):
    """Present in an `infer` to a sequence model: which sequence the request steps, and whether
    it is the sequence's first (`start`) or last (`end`) request. One row per request."""
    id: CorrId
    start: bool = False
    end: bool = False


# ---- broker <-> worker ------------------------------------------------------------------------


class ControlSpec(Struct):
    """A control input the worker feeds a file model, [rows, 1] of `dtype`: start/end/ready are
    1 (true) or 0 (false), corrid the sequence's id (uint64, or a string as BYTES)."""
    kind: str                          # one of CONTROL_KINDS
    name: str                          # the model's input it is fed as
    dtype: str


class ImplicitStateSpec(Struct):
    """One per-sequence state tensor; the pool holds [slots, *shape] of it on the model's device.
    For a file model, `name` is the input it is fed as and `output` the output the model returns
    its next value in (Triton's input_name/output_name); a handler class reads and writes
    `batch.state[name]` itself and has no `output`. A slot is set to `initial` at a start."""
    name: str
    dtype: str
    shape: list[int]
    output: str = ""
    initial: float = 0.0


class SequenceSpec(Struct):
    """A sequence model's declaration as its worker loads it (config `sequence_batching:`)."""
    state: list[ImplicitStateSpec] = []
    controls: list[ControlSpec] = []
    max_sequences: int = 0             # slots; 0: as many as state_memory holds
    state_memory: int = 0              # bytes for the slot pool (used when max_sequences is 0)


class SeqStep(Struct):
    """One request of a sequence model's batch (Batch.steps, in request order = row order)."""
    slot: int                          # the state slot the broker bound its sequence to on this worker
    corrid: CorrId
    start: bool = False                # the worker sets the slot's state to its initial values first
    end: bool = False
