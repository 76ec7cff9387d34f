"""Safe change in pure code (docs/ROLLOUT.md): output comparison, the policy's checks and verdicts,
the shadow level of the batcher, shadow sampling and copies, and the guards' decisions under an
injected clock. No processes."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from fake_clock import Clock
from tgw.broker.canary.compare import OutputDiff, worst
from tgw.broker.canary.guards import Guards
from tgw.broker.canary.policy import Observed, checked, verdict
from tgw.broker.canary.shadow import Shadows
from tgw.broker.sched.batcher import Batcher, Pending
from tgw.broker.sched.copies import Copies
from tgw.shm.errors import TgwError
from tgw.shm.wire import RolloutPolicy


def side(a: np.ndarray) -> tuple:
    return (str(a.dtype), list(a.shape), a.tobytes())


def test_float_scores_give_max_abs_rel_and_top_k_agreement():
    d = OutputDiff("y")
    a = np.array([[0.1, 0.9, 0.0], [0.5, 0.2, 0.3]], np.float32)
    b = a.copy()
    b[1] = [0.1, 0.2, 0.7]                 # row 1's top class moves from 0 to 2
    d.add(side(a), side(b))
    s = d.summary()
    assert s["max_abs_diff"] == pytest.approx(0.4) and s["max_rel_error"] == pytest.approx(0.4 / 0.9, rel=1e-5)
    assert s["top1_agreement"] == 0.5 and s["topk_agreement"] == 1.0   # k = 3 classes: same set
    assert "exact_agreement" not in s


def test_integer_outputs_count_equal_rows_and_a_changed_shape_is_no_agreement():
    d = OutputDiff("labels")
    d.add(side(np.array([[1, 2], [3, 4]], np.int64)), side(np.array([[1, 2], [3, 5]], np.int64)))
    assert d.summary()["exact_agreement"] == 0.5
    d.add(side(np.array([[1, 2]], np.int64)), side(np.array([[1, 2, 3]], np.int64)))
    assert d.summary()["exact_agreement"] == pytest.approx(1 / 3) and d.max_abs == float("inf")


def test_a_nan_on_one_side_only_is_an_infinite_difference():
    d = OutputDiff("y")
    d.add(side(np.array([[np.nan, 1.0]], np.float32)), side(np.array([[np.nan, 1.0]], np.float32)))
    assert d.max_abs == 0.0
    d.add(side(np.array([[1.0, 1.0]], np.float32)), side(np.array([[np.nan, 1.0]], np.float32)))
    assert worst({"y": d})["max_abs_diff"] == float("inf")


@pytest.mark.parametrize("fields, shadow, why", [
    ({"max_error_rate": 1.5}, True, "share in [0, 1]"),
    ({"promote_after_requests": 0}, True, ">= 1"),
    ({"max_p99_ratio": 0.0}, True, "> 0"),
    ({"min_top1_agreement": 0.9}, False, "only for a shadow"),
])
def test_a_wrong_policy_is_refused_naming_its_field(fields, shadow, why):
    with pytest.raises(TgwError) as err:
        checked(RolloutPolicy(**fields), shadow)
    assert why in err.value.message and err.value.details["field"] == next(iter(fields))


def test_verdicts_rollback_at_once_on_a_difference_rates_after_min_requests_then_promote():
    p = RolloutPolicy(promote_after_requests=100, min_requests=20, max_abs_diff=1e-3, max_error_rate=0.1,
                      max_p99_ratio=2.0)
    assert verdict(p, Observed(requests=1, max_abs_diff=0.5))[0] == "rollback"       # no minimum for a difference
    assert verdict(p, Observed(requests=5, errors=5))[0] == "wait"                   # one early failure is no rate
    what, why = verdict(p, Observed(requests=20, errors=3))
    assert what == "rollback" and "15.00%" in why
    assert verdict(p, Observed(requests=50, p99_ms=9.0, serving_p99_ms=4.0))[0] == "rollback"
    assert verdict(p, Observed(requests=99, p99_ms=5.0, serving_p99_ms=4.0))[0] == "wait"
    assert verdict(p, Observed(requests=100, p99_ms=5.0, serving_p99_ms=4.0))[0] == "promote"
    timed = RolloutPolicy(promote_after_s=10.0, min_requests=20)
    assert verdict(timed, Observed(requests=5, elapsed_s=60.0))[0] == "wait"         # time alone is not enough
    assert verdict(timed, Observed(requests=20, elapsed_s=10.0))[0] == "promote"


def copy_of(version: str, shadow: bool = True) -> Pending:
    client = SimpleNamespace(shadow=True, internal=True, ended=lambda p, code: None) if shadow else b"c"
    return Pending(client=client, req_id=0, model="m", version=version, rows=1, shape_key=(), tensors=[b"x" * 4],
                   outputs=["y"], deadline=1e9, priority=3 if shadow else 2, arrived=0.0,
                   record=SimpleNamespace(admitted=lambda: None, left=lambda: False))


def test_copies_wait_below_every_level_never_age_are_shed_first_and_never_take_a_callers_place():
    clock = Clock()
    b = Batcher(clock)
    b.add_model("m", 8, 2, levels=3, aging_batches=1.0)
    b.costs.recent["m"] = 0.001                  # callers' requests would age past two levels in 2 ms
    copies = Copies(b, lambda: True, lambda rec: None)
    assert copies.admit(copy_of("2"))
    clock.t += 10.0
    b.push(copy_of("1", shadow=False))          # a caller's, at the lowest level, young
    assert b.head("m").version == "1"           # the copy, ten seconds old, still goes last
    assert b.queued_by_level("m") == [0, 0, 1]  # callers' levels only
    assert not copies.admit(copy_of("2"))       # full: the copy is dropped, nobody is shed
    shed = b.push(Pending(client=b"c", req_id=9, model="m", version="1", rows=1, shape_key=(), tensors=[b"x" * 4],
                          outputs=["y"], deadline=1e9, priority=0))
    assert shed is not None and shed.version == "2"   # a caller's request sheds the copy first
    copies.withdraw("m", "2")
    assert b.queued("m") == 2


def test_shadows_copy_their_fraction_of_answered_requests_exactly():
    entry = SimpleNamespace(decl=SimpleNamespace(timeout_ms=1000, priority_levels=3),
                            records={"2": SimpleNamespace()})
    queued = []
    shadows = Shadows({"m": entry}, lambda p: queued.append(p) or True, lambda m, v: None, Clock())
    watch = shadows.start("m", "2", 0.25)
    view = {"y": (SimpleNamespace(dtype="float32", shape=[1, 2]), memoryview(np.zeros(2, np.float32).tobytes()))}
    answered = [(copy_of("1", shadow=False), view) for _ in range(40)]
    shadows.sample(answered, 0.0)
    assert watch.copied == len(queued) == 10
    assert all(p.version == "2" and p.priority == 3 and p.client.serving["y"][2] == bytes(8) for p in queued)
    shadows.sample([(copy_of("2", shadow=False), view)], 0.0)   # the shadow's own version: never copied
    assert watch.copied == 10
    steps = [(copy_of("1", shadow=False), view) for _ in range(8)]
    for p, _ in steps:
        p.sequence = object()   # a sequence model's step (broker/sequence/): its answer is its state's
    shadows.sample(steps, 0.0)
    assert watch.copied == 10


def test_guards_decide_once_and_count():
    clock = Clock()
    shadows = Shadows({}, lambda p: True, lambda m, v: None, clock)
    guards = Guards(shadows, clock)
    guards.watch("m", "2", "canary", RolloutPolicy(promote_after_requests=3, min_requests=3))
    ok = [SimpleNamespace(version="2", model="m", arrived=clock.t - 0.01, client=b"c") for _ in range(3)]
    guards.exits(ok, None, clock.t)
    decided = guards.check(clock.t)
    decided += guards.check(clock.t)                # decided already: not twice
    assert [d[0] for d in decided] == ["promote"] and guards.counts[("m", "promote")] == 1
    assert guards.status()["decisions"][0]["figures"]["requests"] == 3
    guards.gone("m", ["2"])
    assert guards.status()["guarded"] == []
