"""The replay warm-up's sample (broker/models/replay.py), pure: per model each distinct (shape,
batch rows) seen, bounded and newest kept; payloads only with warmup.replay_payloads, bounded in
bytes; settings a reload changes take effect at once; what a load's Replay carries; and the
config's bound on max_s."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import unloaded_model
from tgw.broker.config.load import ConfigError, ModelDecl, WarmupDecl, parse_config
from tgw.broker.models.entry import ModelEntry
from tgw.broker.models.replay import ReplayRecorder, summary
from tgw.broker.state.pending import TAG
from tgw.broker.state.pending import Pending
from tgw.shm.wire import ReplayReport, as_builtins

OUT = [{"name": "y", "dtype": "float32", "shape": [-1]}]


def entry(name: str = "var", shape: list[int] | None = None, **extra) -> ModelEntry:
    """A model of one float32 input `x` (by default [-1]: its batches carry their shapes)."""
    source = {"handler": "pkg.mod:Stage"} if extra.pop("stage", False) else {"path": "m.pt"}
    return ModelEntry(ModelDecl.model_validate({
        "name": name, "versions": [{"version": "1", **source}], "max_batch_size": 64, **extra,
        "inputs": [{"name": "x", "dtype": "float32", "shape": shape or [-1]}], "outputs": OUT}))


def request(width: int, rows: int = 1, fill: float = 0.0, variable: bool = True, cuda: bool = False) -> Pending:
    """An admitted request of `rows` rows of `width` float32s, as admission makes it."""
    data = np.full((rows, width), fill, np.float32).tobytes()
    key = ((width,),) if variable else ()
    if cuda:
        key = (*key, (TAG, 0, "GPU-0", "in"))
    return Pending(client=b"c", req_id=0, model="var", version="1", rows=rows, shape_key=key, tensors=[data],
                   outputs=["y"], deadline=0.0, cuda=object() if cuda else None)


def recorder(**warmup) -> ReplayRecorder:
    return ReplayRecorder(WarmupDecl(**warmup))


def plan(r: ReplayRecorder, e: ModelEntry) -> list[tuple[int, list]]:
    """(rows, shapes) of each batch a load of `e` would replay, in the order it would."""
    replay = r.replay(e)
    return [(b.rows, b.shapes) for b in replay.batches] if replay else []


def test_each_distinct_shape_and_batch_size_is_kept_once_newest_first():
    r, e = recorder(), entry()
    for width, rows in [(16, 1), (32, 3), (16, 1), (16, 2), (32, 3)]:
        r.record(e, [request(width, rows)])
    r.record(e, [request(16, 1), request(16, 2)])   # a batch of two requests: 3 rows at width 16
    assert plan(r, e) == [(3, [[16]]), (3, [[32]]), (2, [[16]]), (1, [[16]])]
    assert r.as_dict("var") == {"samples": 4, "payload_bytes": 0}
    assert r.replay(e).max_s == 30.0


def test_the_sample_is_bounded_and_the_oldest_goes_first():
    r, e = recorder(samples=3), entry()
    for width in (8, 16, 24, 32):
        r.record(e, [request(width)])
    r.record(e, [request(16)])   # seen again: newest again
    r.record(e, [request(40)])
    assert plan(r, e) == [(1, [[40]]), (1, [[16]]), (1, [[32]])]


def test_a_model_of_fixed_shapes_replays_its_declared_shapes_at_each_batch_size():
    r, e = recorder(), entry("fixed", shape=[4])
    for rows in (1, 5, 1):
        r.record(e, [request(4, rows, variable=False)])
    assert plan(r, e) == [(1, [[4]]), (5, [[4]])]


def test_no_payload_is_kept_or_sent_unless_configured():
    r, e = recorder(), entry()
    r.record(e, [request(4, 2, fill=7.0)])
    assert [b.payload for b in r.replay(e).batches] == [[]]
    assert r.as_dict("var")["payload_bytes"] == 0


def test_with_replay_payloads_a_batch_keeps_its_requests_bytes_in_order():
    r, e = recorder(replay_payloads=True), entry()
    a, b = request(4, 1, fill=1.0), request(4, 2, fill=2.0)
    r.record(e, [a, b])
    [batch] = r.replay(e).batches
    assert batch.rows == 3 and batch.payload == [a.tensors[0] + b.tensors[0]]
    assert r.as_dict("var") == {"samples": 1, "payload_bytes": 48}


def test_payloads_are_bounded_in_bytes_and_cuda_tensors_keep_none():
    r, e = recorder(replay_payloads=True, payload_mb=1), entry()
    r.record(e, [request(1 << 17, 1)])   # 512 KiB
    r.record(e, [request(1 << 17, 2)])   # 1 MiB more: over the budget, its shape kept alone
    r.record(e, [request(8, 1, cuda=True)])   # bound to a GPU: the broker never held its bytes
    assert [(b.rows, b.shapes, len(b.payload)) for b in r.replay(e).batches] == [
        (1, [[8]], 0), (2, [[1 << 17]], 0), (1, [[1 << 17]], 1)]
    assert r.as_dict("var")["payload_bytes"] == 512 << 10


def test_a_reload_that_turns_payloads_off_drops_them_and_a_smaller_bound_trims():
    r, e = recorder(replay_payloads=True), entry()
    for width in (4, 8, 12):
        r.record(e, [request(width)])
    r.configure(WarmupDecl(samples=2), ["var"])
    assert plan(r, e) == [(1, [[12]]), (1, [[8]])]
    assert all(b.payload == [] for b in r.replay(e).batches) and r.as_dict("var")["payload_bytes"] == 0
    r.configure(WarmupDecl(), ["other"])   # the model is gone from the config
    assert r.replay(e) is None and r.as_dict("var") == {"samples": 0, "payload_bytes": 0}


def test_replay_off_records_nothing_and_stages_are_never_recorded():
    off, e = recorder(replay=False), entry()
    off.record(e, [request(4)])
    assert off.replay(e) is None and off.samples == {}
    r, stage = recorder(), entry("stage", stage=True)
    r.record(stage, [request(4)])
    assert r.replay(stage) is None and r.samples == {}


def test_the_summary_names_rounds_batches_p99_and_the_outcome():
    report = ReplayReport(rounds=3, covered=[], p99_ms=[201.5, 0.4, 0.41], settled=True, seconds=0.62)
    assert summary(as_builtins(report)) == ("replay warm-up: 3 round(s) of 0 batch(es), p99 201.5 -> 0.4 -> 0.41 "
                                            "ms, settled in 0.62 s")
    assert "not settled within warmup.max_s" in summary(as_builtins(ReplayReport(rounds=1, p99_ms=[5.0])))


def test_max_s_must_leave_the_load_time_within_start_timeout_s(tmp_path):
    unloaded_model(tmp_path / "m.pt")
    model = {"name": "m", "versions": [{"version": "1", "path": "m.pt"}], "outputs": OUT,
             "inputs": [{"name": "x", "dtype": "float32", "shape": [-1]}]}
    assert parse_config({"models": [model], "warmup": {"max_s": 60}}, base_dir=str(tmp_path)).warmup.max_s == 60
    with pytest.raises(ConfigError, match=r"warmup.max_s \(120\) must be less than workers.start_timeout_s \(120\)"):
        parse_config({"models": [model], "warmup": {"max_s": 120}}, base_dir=str(tmp_path))
