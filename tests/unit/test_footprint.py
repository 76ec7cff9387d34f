"""Measured memory (docs/MEMORY.md): the worker's footprint arithmetic and CPU gauge, the
fragmentation judge, spread and pack placement, and where footprints are reported."""
from __future__ import annotations

import torch

from tgw.broker.config.load import FragmentationDecl
from tgw.broker.fleet.fragmentation import FragmentationJudge, cuda_waste, need, over_bounds
from tgw.broker.protocol.triton_docs import memory_usage
from tgw.broker.models.residency import Residency
from tgw.broker.state.pool import WorkerHandle
from tgw.shm.wire import Footprint, ModelLoaded, WorkerReady, encode, from_worker_decoder
from tgw.workers.footprint import Gauge, compose, grown, status_bytes

MIB = 1 << 20


def test_compose_takes_the_largest_size_and_never_less_than_the_parameter_bytes():
    fp = compose(3, {1: 10, 16: 70}, "cpu", floor=5)
    assert (fp.weights, fp.activation_peak, fp.total, fp.by_batch) == (5, 70, 75, {1: 10, 16: 70})
    assert grown(10, 4) == 0 and status_bytes("VmHWM:\t  12 kB\nRssAnon:  3 kB\n", "VmHWM") == 12 * 1024


def test_the_cpu_gauge_sees_a_batchs_peak_that_is_gone_after_it():
    gauge = Gauge(torch.device("cpu"))
    by_batch = gauge.per_batch([1, 2], lambda rows: torch.ones(rows * 8 * MIB // 4).add_(1).sum())
    assert by_batch[2] >= 15 * MIB and by_batch[1] >= 7 * MIB, by_batch   # VmHWM, reset per size


def test_footprints_travel_on_ready_and_loaded_and_old_peers_decode():
    fp = Footprint(weights=1, activation_peak=2, by_batch={4: 2}, measured_on="cuda")
    ready = from_worker_decoder.decode(encode(WorkerReady(worker_id=0, models=["m:1"], footprints={"m:1": fp})))
    assert ready.footprints["m:1"] == fp
    assert from_worker_decoder.decode(encode(ModelLoaded(worker_id=0, key="m:1"))).footprint is None


def test_fragmentation_needs_every_bound_set_and_beats_in_a_row():
    decl = FragmentationDecl(max_mb=1.0, max_share=0.5, beats=2)
    assert over_bounds(decl, 2 * MIB, 3 * MIB) and not over_bounds(decl, 2 * MIB, 5 * MIB)   # share not passed
    assert not over_bounds(decl, MIB // 2, MIB // 2 + 1)                                       # MiB not passed
    assert not over_bounds(FragmentationDecl(max_mb=None, max_share=None), 1 << 40, 1)
    judge = FragmentationJudge(decl)
    assert judge.record(b"w", 4 * MIB, 5 * MIB) == ""
    assert "4.0 MiB" in judge.record(b"w", 4 * MIB, 5 * MIB)
    judge.quiet(b"w")
    assert judge.record(b"w", 4 * MIB, 5 * MIB) == ""


def test_cpu_waste_is_the_rise_over_the_lowest_level_beyond_one_batchs_activations():
    judge = FragmentationJudge(FragmentationDecl())
    assert judge.cpu_waste(b"w", 100 * MIB, 10 * MIB, 5 * MIB) == (0, 100 * MIB)
    assert judge.cpu_waste(b"w", 104 * MIB, 10 * MIB, 5 * MIB) == (0, 104 * MIB)      # a batch's peak
    assert judge.cpu_waste(b"w", 120 * MIB, 10 * MIB, 5 * MIB) == (15 * MIB, 120 * MIB)
    judge.quiet(b"w")   # a load or unload keeps the level
    assert judge.cpu_waste(b"w", 120 * MIB, 10 * MIB, 5 * MIB)[0] == 15 * MIB
    judge.forget(b"w")
    assert judge.cpu_waste(b"w", 120 * MIB, 10 * MIB, 5 * MIB)[0] == 0
    assert cuda_waste(10 * MIB, 4 * MIB, 2 * MIB) == (4 * MIB, 10 * MIB)
    assert need([Footprint(weights=3, activation_peak=7), Footprint(weights=4, activation_peak=2)]) == (7, 7)


class W:   # the fields of a WorkerHandle that placement reads, and the methods that change them
    want, evict = WorkerHandle.want, WorkerHandle.evict

    def __init__(self, name, used, budget, device="cpu"):
        from tgw.broker.state.pool import Holding, WorkerState
        self.name, self.budget, self.device, self.state, self.retiring, self.inflight = name, budget, device, \
            WorkerState.READY, False, {}
        self.models, self.sizes, self.holding = {f"{name}:1"}, {f"{name}:1": used}, Holding()
        self.footprints = {f"{name}:1": Footprint(weights=used, measured_on="cpu")}


def test_spread_takes_the_most_room_and_pack_the_fullest_that_fits():
    from tgw.broker.config.schema import VersionDecl
    from tgw.broker.state.versions import VersionRecord, VersionState
    rec = VersionRecord("new", VersionDecl(version="1", path="/m/new.pt"), VersionState.READY, True)
    rec.footprint = Footprint(weights=30 * MIB, measured_on="cpu")
    recs = {rec.key: rec}

    def roster():
        return [W("empty", 0, 100 * MIB), W("half", 50 * MIB, 100 * MIB), W("full", 80 * MIB, 100 * MIB)]
    assert Residency(recs.get, lambda *a, **k: None, "spread").place(rec, roster()).name == "empty"
    assert Residency(recs.get, lambda *a, **k: None, "pack").place(rec, roster()).name == "half"
    tight = [W("a", 90 * MIB, 100 * MIB), W("b", 95 * MIB, 100 * MIB)]   # fits nowhere: as spread
    assert Residency(recs.get, lambda *a, **k: None, "pack").place(rec, tight).name == "a"


def test_a_measured_load_larger_than_counted_evicts_what_no_longer_fits():
    recs = {}
    w = W("old", 40 * MIB, 100 * MIB)
    w.holding.wanted |= {"old:1", "new:1"}
    w.holding.used_at = {"old:1": 1.0, "new:1": 2.0}
    w.models.add("new:1")
    w.footprints["new:1"] = Footprint(weights=70 * MIB, measured_on="cpu")
    Residency(recs.get, lambda *a, **k: None).settle(w, "new:1")
    assert w.holding.evicting == {"old:1"}


def test_a_version_never_measured_counts_its_parameters_plus_the_workers_largest_activation():
    from tgw.broker.config.schema import VersionDecl
    from tgw.broker.state.versions import VersionRecord, VersionState
    rec = VersionRecord("new", VersionDecl(version="1", path="/m/new.pt"), VersionState.READY, True)
    rec.bytes = 2 * MIB   # parameter bytes, from an earlier load that measured nothing
    w = W("held", 10 * MIB, 100 * MIB)
    res = Residency({rec.key: rec}.get, lambda *a, **k: None)
    assert res.size(w, "new:1") == 2 * MIB    # nothing measured shows an activation yet
    w.footprints["held:1"] = Footprint(weights=10 * MIB, activation_peak=60 * MIB, measured_on="cpu")
    assert res.size(w, "new:1") == 62 * MIB   # a batch of it may well need what one of held:1's did
    rec.footprint = Footprint(weights=3 * MIB, activation_peak=1 * MIB, measured_on="cpu")
    assert res.size(w, "new:1") == 4 * MIB    # once measured anywhere, that


def test_triton_memory_usage_lists_each_device_holding_the_version():
    gpu, cpu = W("m", 5, None, device="cuda:1"), W("m", 7, None)
    assert memory_usage([gpu, cpu], "m:1") == [{"type": "GPU", "id": 1, "byte_size": 5},
                                              {"type": "CPU", "id": 0, "byte_size": 7}]
