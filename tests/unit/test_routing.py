"""The canary split (broker/models/entry.py, Traffic), pure: shares over a run of requests, sticky routing
keys, and what moves when weights change."""
from __future__ import annotations

import pytest

from tgw.broker.models.entry import Traffic


@pytest.mark.parametrize("weights", [{"1": 90, "2": 10}, {"1": 1, "2": 1, "3": 1}, {"a": 7, "b": 0, "c": 93}])
@pytest.mark.parametrize("n", [100, 20_000])
def test_unkeyed_shares_are_exact_over_any_run(weights, n):
    t = Traffic(weights)
    picks = [t.pick() for _ in range(n)]
    total = sum(weights.values())
    for version, w in weights.items():
        # a low-discrepancy sequence: off by a few requests, not by sampling noise
        assert abs(picks.count(version) - n * w / total) <= 3, (version, picks.count(version))


def test_a_routing_key_always_gets_the_same_version_and_keys_split_by_weight():
    t = Traffic({"1": 90, "2": 10})
    first = {f"user-{i}": t.pick(f"user-{i}") for i in range(5000)}
    for _ in range(3):
        assert {k: t.pick(k) for k in first} == first
    share = sum(v == "2" for v in first.values()) / len(first)
    assert 0.08 < share < 0.12   # a hash, so a sample: 5,000 keys at 10 % have a 0.4-point deviation


def test_moving_weight_moves_only_the_keys_in_the_interval_that_moved():
    keys = [f"k{i}" for i in range(5000)]
    before = Traffic({"1": 90, "2": 10})
    after = Traffic({"1": 80, "2": 20})
    moved = [k for k in keys if before.pick(k) != after.pick(k)]
    assert moved and all(before.pick(k) == "1" and after.pick(k) == "2" for k in moved)


def test_zero_weights_route_nowhere_and_one_version_takes_everything():
    assert Traffic({}).pick() is None and Traffic({"1": 0}).pick("k") is None
    assert not Traffic({"1": 0})
    one = Traffic({"7": 3, "8": 0})
    assert {one.pick(), one.pick("k")} == {"7"}
    assert one.share("7") == 1.0 and one.share("8") == 0.0
