"""The wire contract of generation: requests that answer many times (docs/GENERATION.md,
docs/PROTOCOL.md "Generation").

Imported through tgw.shm.wire like every other message.

A caller asks with an ordinary `infer` whose `generate` field is set (GenerateParams): the
request is admitted, queued and batched like any other (priorities, deadlines, tenants, breaker,
max_queue), and its batch reaches a worker through the ring like any other. The worker does not
answer the batch with outputs: it admits each request as a sequence into its step loop and
answers the batch (Done, no outputs) once it has taken the prompts. From then on each step's
outputs, of every row, travel worker -> broker as one `Steps` message (a step's outputs are a few
bytes per row: they ride inside it, not in the output arena), and the broker answers each caller
at once with `GenerateOutputs`, then one `GenerateEnd` (or an `error`) closes the stream.
"""
from __future__ import annotations

from typing import Optional

import msgspec

from .wire_base import ErrorBody, Struct, TensorMeta

# ---- caller -> broker (inside Infer.generate) -------------------------------------------------


class Sampling(Struct):
    """How each output is picked from the logits a sampled generator returns. The randomness of
    the output at position n depends only on (seed, n): never on the batch's other rows, nor on
    which worker serves it. Ignored by a generator that returns its outputs itself."""
    temperature: float = 0.0           # 0: greedy (argmax); > 0: softmax(logits / temperature)
    top_k: int = 0                     # keep the k most likely (0: all)
    top_p: float = 1.0                 # keep the smallest set whose probability reaches top_p (1.0: all)
    seed: Optional[int] = None         # None: the broker draws one (reported in GenerateEnd.seed)
    stop_tokens: list[int] = []        # end the sequence when one is picked (it is not emitted)
    stop_sequences: list[list[int]] = []   # end it when its outputs end with one (emitted)


class GenerateParams(Struct):
    """Present in an `infer`: the request is a generation (its model must be a generator)."""
    max_outputs: Optional[int] = None  # None: the model's generator.max_outputs (also the cap)
    sampling: Sampling = msgspec.field(default_factory=Sampling)


# ---- broker -> caller -------------------------------------------------------------------------


class GenerateOutputs(Struct, tag_field="op", tag="gen"):
    """Outputs `first` .. `first + count - 1` of the sequence `id`: one tensor per declared output,
    shaped [count, *declared shape], its bytes in the frames that follow (as an InferReply's)."""
    v: int
    id: int
    first: int                         # position of the first output carried here (0-based)
    count: int
    outputs: list[TensorMeta]


class GenerateEnd(Struct, tag_field="op", tag="gen_end"):
    """The stream's last message: every output was sent before it."""
    v: int
    id: int
    model: str
    version: str
    # max_outputs, stop_token, stop_sequence, max_length (the state's length would be passed),
    # done (the generator said so)
    reason: str
    outputs: int                       # outputs sent, in all
    seed: Optional[int] = None         # the seed that was used (sampled requests)
    first_output_ms: float = 0.0       # from the broker's receipt to its first output
    total_ms: float = 0.0              # from the broker's receipt to this end
    resumed: int = 0                   # times the sequence was prefilled again after its worker died
    traceparent: Optional[str] = None


# ---- broker <-> worker ------------------------------------------------------------------------


class StateSpec(Struct):
    """One per-sequence state tensor: the pool holds [slots, *shape] of it on the model's device."""
    name: str
    dtype: str
    shape: list[int]


class GeneratorSpec(Struct):
    """A generator's declaration as its worker loads it (config `generator:`)."""
    state: list[StateSpec]
    max_sequences: int = 0             # slots; 0: as many as state_memory holds
    state_memory: int = 0              # bytes for the slot pool (used when max_sequences is 0)
    max_length: int = 0                # a sequence's positions (prompt + outputs) at most; 0: no limit
    length_input: str = ""             # the input whose element count is the prompt's length ("": the first)
    max_outputs: int = 256
    max_prefill_rows: int = 8          # new sequences prefilled per step at most
    end_tokens: list[int] = []         # stop tokens of the model itself (a sampled generator's)


class GenSeq(Struct):
    """One request of an admission batch (Batch.sequences, in request order)."""
    seq: int                           # the broker's sequence id (unique per broker life)
    max_outputs: int
    sampling: Sampling = msgspec.field(default_factory=Sampling)
    # a resumed sequence: the outputs already delivered, one tensor per declared output,
    # [n, *declared shape], raw bytes (the worker prefills with them appended; n = `delivered`)
    delivered: int = 0
    prefix: list[bytes] = []


class StepRows(Struct):
    """One declared output's values for the rows of a Steps message: [rows, *shape], raw bytes."""
    name: str
    dtype: str
    shape: list[int]
    data: bytes


class SeqEnd(Struct):
    """A sequence the worker ended at this step, its slot freed."""
    seq: int
    reason: str                        # as GenerateEnd.reason, or cancelled, or error
    error: Optional[ErrorBody] = None  # reason "error": the handler's (or the worker's) error


class Steps(Struct, tag_field="op", tag="w_steps"):
    """Worker -> broker, once per step of a generator's loop: every output of the step (rows of
    prefilled sequences and of stepped ones alike), and the sequences it ended."""
    worker_id: int
    key: str                           # model:version
    seqs: list[int] = []               # the sequence of each row, in row order
    positions: list[int] = []          # each row's output position (0 = a sequence's first output)
    outputs: list[StepRows] = []
    ended: list[SeqEnd] = []           # after this step's outputs (a row that ends here emitted its last)
    active: int = 0                    # sequences in the loop after this step
    slots: int = 0                     # the pool's size
    freed: int = 0                     # slots freed by cancellation since the worker started (a count)
    step_us: int = 0                   # this step's compute (prefill and step together)
    prefilled: int = 0                 # rows prefilled in this step


class CancelSequences(Struct, tag_field="op", tag="w_seq_cancel"):
    """Broker -> worker: end these sequences at the next step boundary (nobody waits for them)."""
    seqs: list[int]
    reason: str = "cancelled"
