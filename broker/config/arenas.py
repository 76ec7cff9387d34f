"""Each worker's shared-memory arenas, sized from the model declarations (`*_arena_mb: auto`).

The rule (docs/CONFIGURATION.md, configs/example.yaml):

* A model's batch bound is one block of `max_batch_size` rows: one 64-byte aligned region per
  declared tensor, as the broker stages inputs and the worker writes outputs (ring.aligned_total).
* k = server.max_inflight_batches_per_worker blocks may be live in an arena at once (the worker
  runs batches in order, so blocks are freed oldest first). A ring of (k + 1) x the bound always
  has room for the k-th: with k - 1 blocks live, the free space is at least 2 x bound, split at
  most into the gap before the end and the gap before the oldest block, one of which holds it.
* Input arena: the largest such need over the models. A model with a -1 input dim has no row
  size; any request of it that admission accepts (server.max_request_bytes) must still fit, so
  it needs one block of max_request_bytes (plus one alignment pad per further input). Its batches
  pipeline while k of them fit; a larger one waits for the previous to finish. A `bytes` input
  (variable-length elements: a stage's) has no row size either and is sized the same way.
* Output arena: the same from the declared outputs. A model with a -1 output dim needs
  max(VARIABLE_OUTPUT_BYTES, (k + 1) x its fixed outputs' bound), and so does one with a bytes
  output (its fixed outputs: those with neither): its outputs are sized only
  after compute, and a batch whose outputs do not fit is written in parts at request boundaries
  (workers/serve.py), so only a single request whose outputs alone exceed the arena is refused.
* Each arena is rounded up to whole MiB, at least 1 MiB.

Explicit sizes (an integer number of MiB) are kept as given.
"""
from __future__ import annotations

from math import prod
from typing import Optional, Sequence

from tgw.shm.ring import ALIGN, align_up, aligned_total
from tgw.shm.wire import BYTES, DTYPE_SIZES

from .schema import Config, ModelDecl, TensorDecl

MIB = 1 << 20
VARIABLE_OUTPUT_BYTES = 8 * MIB   # a model with a -1 output dim gets at least this output arena


def sized(t: TensorDecl) -> bool:
    """Whether a tensor's bytes per row are known from its declaration (no -1 dim, not bytes)."""
    return t.dtype != BYTES and -1 not in t.shape


def batch_bytes(tensors: Sequence[TensorDecl], rows: int) -> Optional[int]:
    """One block holding `rows` rows of every tensor, each region aligned; None with a -1 dim
    or a bytes tensor."""
    if not all(sized(t) for t in tensors):
        return None
    return aligned_total([rows * DTYPE_SIZES[t.dtype] * prod(t.shape) for t in tensors])


def input_need(model: ModelDecl, max_inflight: int, max_request_bytes: int) -> int:
    """Bytes of input arena this model needs (the rule above)."""
    block = batch_bytes(model.inputs, model.max_rows)
    if block is None:  # the largest admissible request, laid out in aligned regions
        return align_up(max_request_bytes) + ALIGN * (len(model.inputs) - 1)
    return (max_inflight + 1) * block


def output_need(model: ModelDecl, max_inflight: int) -> int:
    """Bytes of output arena this model needs (the rule above)."""
    block = batch_bytes(model.outputs, model.max_rows)
    if block is None:
        fixed = [t for t in model.outputs if sized(t)]
        return max(VARIABLE_OUTPUT_BYTES, (max_inflight + 1) * (batch_bytes(fixed, model.max_rows) or 0))
    return (max_inflight + 1) * block


def whole_mib(nbytes: int) -> int:
    return max(MIB, -(-nbytes // MIB) * MIB)


def auto_sizes(cfg: Config) -> tuple[int, int]:
    """(input, output) arena bytes per worker that `auto` means for this config."""
    k, limit = cfg.server.max_inflight_batches_per_worker, cfg.server.max_request_bytes
    return (whole_mib(max((input_need(m, k, limit) for m in cfg.models), default=0)),   # no models yet: a
            whole_mib(max((output_need(m, k) for m in cfg.models), default=0)))            # model store's first


def resolve(cfg: Config) -> Config:
    """The config with each worker's arena sizes fixed (workers.input_bytes / output_bytes)."""
    auto_in, auto_out = auto_sizes(cfg)
    w = cfg.workers.model_copy()
    w._input_bytes = auto_in if w.input_arena_mb == "auto" else w.input_arena_mb * MIB
    w._output_bytes = auto_out if w.output_arena_mb == "auto" else w.output_arena_mb * MIB
    return cfg.model_copy(update={"workers": w})


def describe(cfg: Config) -> str:
    """One line: each worker's arena sizes and where they came from."""
    w = cfg.workers

    def one(key: str, nbytes: int) -> str:
        return f"{nbytes // MIB} MiB (workers.{key}: {getattr(w, key)})"
    return (f"shared memory per worker: input arena {one('input_arena_mb', w.input_bytes)}, "
            f"output arena {one('output_arena_mb', w.output_bytes)}")
