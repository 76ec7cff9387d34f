"""Picking each row's output from the logits a sampled generator returns (docs/GENERATION.md
"Sampling"), batched: greedy (argmax) when a row's temperature is 0, else softmax(logits /
temperature) kept to its top_k most likely and then to the smallest set whose probability reaches
top_p (renormalised after top_k), and one token drawn by inverse CDF.

The randomness of a sequence's output n is one uniform number that depends only on (seed, n): a
counter-based hash (splitmix64's finaliser), not a generator's state. So an output never depends
on the batch's other rows, on the order rows were admitted, nor on which worker computes it, and a
sequence prefilled again after its worker died continues exactly. The arithmetic is float64 and
row-wise (a row's softmax and cumulative sums read that row alone), ties in the ordering are
broken by token index (a stable sort).
"""
from __future__ import annotations

from typing import Sequence

import torch

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
STREAM = 0xD1B54A32D192ED03   # a second odd constant: the position's own stream
TWO_TO_MINUS_53 = 2.0 ** -53


def _mix64(z: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers that scatters every input bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def uniform(seed: int, position: int) -> float:
    """The uniform number in [0, 1) of output `position` of a sequence seeded `seed`."""
    z = _mix64((seed * GOLDEN + (position + 1) * STREAM) & MASK64)
    return (_mix64(z ^ GOLDEN) >> 11) * TWO_TO_MINUS_53


def bad_rows(logits: torch.Tensor) -> list[int]:
    """Rows no output can be picked from: a NaN or +inf anywhere, or no finite value at all."""
    bad = torch.isnan(logits).any(1) | torch.isposinf(logits).any(1) | torch.isneginf(logits).all(1)
    return bad.nonzero().flatten().tolist()


def sample(logits: torch.Tensor, temperature: Sequence[float], top_k: Sequence[int], top_p: Sequence[float],
           seeds: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
    """Each row's output (a long tensor [rows] on the CPU) from `logits` [rows, vocab], by the
    row's parameters; `seeds` and `positions` name each row's random number. Rows of `bad_rows`
    give an arbitrary output (the caller fails them)."""
    x = logits.detach().to("cpu", torch.float64)
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.long)
    if rows == 0:
        return out
    x = torch.nan_to_num(x, nan=0.0, posinf=0.0)   # a bad row's (see bad_rows): anything but NaN downstream
    x[torch.isneginf(x).all(1)] = 0.0
    temps = torch.tensor([float(t) for t in temperature], dtype=torch.float64)
    greedy = temps <= 0
    if bool(greedy.any()):
        out[greedy] = x[greedy].argmax(1)   # ties: the first index
    hot = (~greedy).nonzero().flatten()
    if hot.numel():
        idx = hot.tolist()
        z = x[hot] / temps[hot, None]
        probs = torch.softmax(z, dim=1)
        sp, order = torch.sort(probs, dim=1, descending=True, stable=True)
        rank = torch.arange(vocab).expand_as(sp)
        k = torch.tensor([vocab if top_k[i] <= 0 or top_k[i] > vocab else top_k[i] for i in idx])
        keep = rank < k[:, None]
        kept = sp * keep
        before = (torch.cumsum(kept, dim=1) - kept) / kept.sum(1, keepdim=True)
        p = torch.tensor([float(top_p[i]) for i in idx], dtype=torch.float64)
        keep &= (before < p[:, None]) | (rank == 0)   # the most likely is always kept
        cdf = torch.cumsum(sp * keep, dim=1)
        u = torch.tensor([uniform(seeds[i], positions[i]) for i in idx], dtype=torch.float64)
        # the kept tokens are a prefix of the sorted order: the draw lands among them (the clamp
        # holds it there should u * total round up to the total)
        j = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
        j = torch.minimum(j, keep.sum(1, keepdim=True) - 1)
        out[hot] = order.gather(1, j).flatten()
    return out
