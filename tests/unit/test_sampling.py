"""Sampling on the worker (workers/generate/sampling.py) and a sequence's ends (stops.py): greedy,
the top-k and top-p masks, the randomness of (seed, position) alone, whatever the batch, and a
bounded sample's distribution. The hash is deterministic: every figure here is the same each run."""
from __future__ import annotations

import math

import torch

from tgw.workers.generate.sampling import bad_rows, sample, uniform
from tgw.workers.generate.stops import Stops, after_emit


def draw(logits, temperature=1.0, top_k=0, top_p=1.0, seed=0, position=0) -> int:
    rows = logits if logits.dim() == 2 else logits[None]
    return int(sample(rows, [temperature], [top_k], [top_p], [seed], [position])[0])


def log_probs(*p: float) -> torch.Tensor:
    return torch.tensor([math.log(x) for x in p], dtype=torch.float32)


def test_uniform_depends_on_seed_and_position_only_and_lies_in_0_1():
    values = {(s, n): uniform(s, n) for s in (0, 1, 2**40, -5) for n in range(50)}
    assert all(0.0 <= u < 1.0 for u in values.values())
    assert len(set(values.values())) == len(values)        # no two (seed, position) share a draw
    assert uniform(7, 3) == uniform(7, 3)


def test_greedy_is_argmax_with_ties_to_the_first_and_per_row_temperature():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 0.0, 0.0, 0.0], [0.0, 0.0, 9.0, 0.0]])
    out = sample(logits, [0.0, 0.0, 0.5], [0, 0, 0], [1.0] * 3, [1, 2, 3], [0, 0, 0])
    assert out.tolist()[:2] == [1, 0] and out.dtype == torch.long
    assert out.tolist()[2] == 2   # a sampled row beside greedy ones: its mass is nearly all on token 2


def test_top_k_keeps_only_the_k_most_likely():
    logits = log_probs(0.05, 0.4, 0.1, 0.3, 0.15)
    picked = {draw(logits, top_k=2, position=n) for n in range(300)}
    assert picked == {1, 3}
    assert {draw(logits, top_k=1, seed=s, position=n, temperature=3.0) for s in range(5) for n in range(20)} == {1}


def test_top_p_keeps_the_smallest_set_that_reaches_it():
    logits = log_probs(0.5, 0.3, 0.15, 0.05)
    # (thresholds clear of the sums: float rounding never decides these)
    assert {draw(logits, top_p=0.79, position=n) for n in range(300)} == {0, 1}   # 0.5 + 0.3 reaches 0.79
    assert {draw(logits, top_p=0.81, position=n) for n in range(300)} == {0, 1, 2}
    assert {draw(logits, top_p=0.01, position=n) for n in range(50)} == {0}      # the most likely is always kept
    # after top_k the kept mass is renormalised: 0.5 / 0.8 = 0.625 reaches 0.6
    assert {draw(logits, top_k=2, top_p=0.6, position=n) for n in range(300)} == {0}


def test_a_rows_output_does_not_depend_on_its_batch_neighbours():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    temps, ks, ps = [0.7, 1.0, 0.0, 1.3, 0.9, 2.0], [0, 10, 0, 5, 0, 40], [1.0, 0.9, 1.0, 0.95, 0.5, 1.0]
    seeds, positions = [11, 12, 13, 14, 15, 16], [0, 3, 9, 27, 81, 243]
    together = sample(logits, temps, ks, ps, seeds, positions).tolist()
    alone = [draw(logits[r], temps[r], ks[r], ps[r], seeds[r], positions[r]) for r in range(6)]
    assert together == alone
    order = [4, 1, 5, 0, 3, 2]
    shuffled = sample(logits[order], [temps[r] for r in order], [ks[r] for r in order], [ps[r] for r in order],
                      [seeds[r] for r in order], [positions[r] for r in order]).tolist()
    assert shuffled == [together[r] for r in order]


def test_a_bounded_sample_follows_the_distribution():
    p = [0.1, 0.2, 0.3, 0.4]
    n = 4000
    counts = [0] * 4
    for k in range(n):
        counts[draw(log_probs(*p), seed=3, position=k)] += 1
    assert all(abs(c / n - q) < 0.03 for c, q in zip(counts, p)), counts
    # temperature sharpens it: at 0.25 the odds of token 3 over token 2 are (4/3)^4 ~ 3.2
    sharp = [draw(log_probs(*p), temperature=0.25, seed=4, position=k) for k in range(n)]
    assert sharp.count(3) / n > 0.6 > sharp.count(2) / n


def test_rows_with_no_valid_logit_are_reported():
    inf = float("inf")
    logits = torch.tensor([[0.0, 1.0], [float("nan"), 1.0], [inf, 0.0], [-inf, -inf], [-inf, 2.0]])
    assert bad_rows(logits) == [1, 2, 3]
    assert draw(logits[4], temperature=1.0) == 1 and draw(logits[4], temperature=0.0) == 1


def test_stop_sequences_read_the_tail_of_the_outputs_a_resumed_one_included():
    s = Stops([0, 9], [[1, 2, 3], [7]], history=[5, 1, 2])
    assert s.is_stop_token(9) and not s.is_stop_token(3)
    assert s.emitted(3)          # 1, 2 were delivered before the worker died, 3 completes it
    fresh = Stops([], [[4, 4]])
    assert [fresh.emitted(t) for t in (4, 5, 4, 4)] == [False, False, False, True]
    assert not Stops([], []).emitted(1)


def test_the_order_of_the_ends_after_an_output():
    assert after_emit(True, True, 5, 5, 9, 9) == "stop_sequence"
    assert after_emit(False, True, 5, 5, 9, 9) == "done"
    assert after_emit(False, False, 5, 5, 9, 9) == "max_outputs"
    assert after_emit(False, False, 4, 5, 9, 9) == "max_length"
    assert after_emit(False, False, 4, 5, 8, 9) is None and after_emit(False, False, 4, 5, 8, 0) is None
