"""A generation's checks at admission (pure): the model is a generator exactly when the request
says `generate`, one row per request, `max_outputs` within the model's cap, sampling sane; a
seed drawn when none is given. What passes becomes the request's GenSeq (Batch.sequences)."""
from __future__ import annotations

import itertools
import math
import random

from tgw.shm.errors import Code, fail
from tgw.shm.wire import GenerateParams, GenSeq, Sampling

SEED_BITS = 63   # a seed fits an int64 on every side


class GenerateCheck:
    """Numbers each generation (its sequence id, unique for the broker's life) and checks it."""

    def __init__(self, rng: random.Random | None = None):
        self._seq = itertools.count(1)
        self._rng = rng or random.SystemRandom()

    def check(self, entry, msg, rows: int) -> GenSeq | None:
        """The request's GenSeq (None: a plain request of a plain model); raises the TgwError
        that refuses it. `entry`: its model (models/entry.py ModelEntry); `msg`: its Infer."""
        params: GenerateParams | None = msg.generate
        if params is None:
            if entry.is_generator:
                raise fail(Code.INVALID_ARGUMENT, f"model {entry.name!r} is a generator: use Client.generate "
                           "(or an infer with `generate`)", reason="generator_needs_generate", model=entry.name)
            return None
        if not entry.is_generator:
            raise fail(Code.INVALID_ARGUMENT, f"model {entry.name!r} is not a generator: `generate` asks for "
                       "outputs a generator streams; send a plain infer", reason="not_a_generator", model=entry.name)
        if msg.output_region is not None or msg.output_cuda or any(t.cuda is not None for t in msg.inputs):
            raise fail(Code.INVALID_ARGUMENT, "a generation's outputs stream back in frames and its prompt comes in "
                       "frames: no output_region, output_cuda or CUDA input handles", reason="generate_transport")
        if rows != 1:
            raise fail(Code.INVALID_ARGUMENT, f"a generation is one sequence: its inputs have one row (batch "
                       f"dim 1), not {rows}; send one request per prompt", reason="generate_rows", rows=rows)
        cap = entry.decl.generator.max_outputs
        n = cap if params.max_outputs is None else params.max_outputs
        if type(n) is not int or not 1 <= n <= cap:
            raise fail(Code.INVALID_ARGUMENT, f"max_outputs {params.max_outputs!r}: model {entry.name!r} takes 1.."
                       f"{cap} (generator.max_outputs)", reason="max_outputs", limit=cap)
        sampling = _sane(params.sampling)
        if sampling.seed is None:
            sampling = Sampling(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                                seed=self._rng.getrandbits(SEED_BITS), stop_tokens=list(sampling.stop_tokens),
                                stop_sequences=[list(s) for s in sampling.stop_sequences])
        return GenSeq(seq=next(self._seq), max_outputs=n, sampling=sampling)


def _sane(s: Sampling) -> Sampling:
    bad = None
    if not math.isfinite(s.temperature) or s.temperature < 0:
        bad = f"temperature {s.temperature!r}: 0 (greedy) or more"
    elif s.top_k < 0:
        bad = f"top_k {s.top_k!r}: 0 (all) or more"
    elif not math.isfinite(s.top_p) or not 0 < s.top_p <= 1:
        bad = f"top_p {s.top_p!r}: in (0, 1]"
    elif s.seed is not None and not 0 <= s.seed < 1 << 64:
        bad = f"seed {s.seed!r}: 0 .. 2**64-1"
    elif any(not seq for seq in s.stop_sequences):
        bad = "stop_sequences: each is at least one token"
    if bad is not None:
        raise fail(Code.INVALID_ARGUMENT, f"sampling {bad}", reason="sampling")
    return s
