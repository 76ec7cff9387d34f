"""Loads as they move, in the broker (issue 39, point 3): a starting worker takes batches of each
start-up model once it is in (pool.py offers), its loads under way are what `status` lists as a
model's `loading`, the hello names the smallest models first, and the progress lines
(observe/progress.py) print on a terminal in text mode only, unless TGW_PROGRESS says otherwise."""
from __future__ import annotations

import io
import logging
from types import SimpleNamespace

import pytest

from tgw.broker.fleet.handshake import Handshake
from tgw.broker.observe.progress import ProgressLines, took, wanted
from tgw.broker.observe.status import loading
from tgw.broker.state.pool import WorkerHandle, WorkerState
from tgw.shm.segment import Segment, new_name
from tgw.shm.wire import PROTOCOL_VERSION, Footprint, ModelLoaded, ModelSpec, WorkerHello

KB = 64 << 10


@pytest.fixture
def handle():
    seg = Segment.create(new_name("ring"), 2 * KB)
    try:
        yield WorkerHandle(worker_id=0, device="cpu", cpus=[], segment=seg, input_bytes=KB, output_bytes=KB)
    finally:
        try:
            seg.close()
        finally:
            seg.unlink()


def test_a_starting_worker_takes_batches_of_each_model_once_it_is_in(handle):
    handle.spawned(None, now=1.0)
    handle.load_moved("fast:1", "loading", 0.0, now=2.0)
    assert not handle.offers("fast:1") and not handle.can_take("fast:1", 2)
    handle.load_moved("fast:1", "warming", 0.5, now=3.0)
    assert handle.under_way["fast:1"].phase == "warming" and handle.under_way["fast:1"].since == 2.5
    handle.started_serving("fast:1", 64, Footprint(weights=64, measured_on="cpu"))
    assert handle.state is WorkerState.STARTING and handle.under_way == {}
    assert handle.offers("fast:1") and handle.can_take("fast:1", 2) and not handle.can_take("slow:1", 2)
    assert handle.sizes == {"fast:1": 64} and handle.footprints["fast:1"].weights == 64
    handle.load_moved("slow:1", "loading", 0.0, now=4.0)
    handle.met_fault("sticky CUDA error")   # a starting worker that faulted serves nothing more
    assert not handle.offers("fast:1")
    handle.exited("killed")
    assert handle.under_way == {} and not handle.offers("fast:1")


def test_a_run_time_load_under_way_ends_with_its_answer(handle):
    handle.spawned(None)
    handle.became_ready(["a:1"])
    handle.load_sent("b:1", 1.0)
    handle.load_moved("b:1", "loading", 0.0, now=2.0)
    handle.loaded("b:1", 8, None, 3.0)
    handle.load_moved("c:1", "loading", 0.0, now=4.0)
    handle.load_failed("c:1")
    assert handle.under_way == {} and handle.offers("b:1")
    handle.load_moved("d:1", "warming", 1.0, now=5.0)
    handle.told_to_stop()   # what a stopping worker still loads serves nobody
    assert handle.under_way == {} and not handle.offers("a:1")


def test_status_lists_a_models_loads_with_worker_phase_and_seconds(handle):
    handle.spawned(None)
    handle.load_moved("slow:2", "loading", 0.25, now=10.0)
    handle.load_moved("slow:1", "warming", 1.5, now=10.0)
    handle.load_moved("slower:1", "loading", 0.0, now=10.0)
    view = SimpleNamespace(roster=[handle])
    assert loading(view, SimpleNamespace(name="slow"), now=12.0) == [
        {"version": "1", "worker": "worker0[cpu]", "phase": "warming", "seconds": 3.5},
        {"version": "2", "worker": "worker0[cpu]", "phase": "loading", "seconds": 2.25}]
    assert loading(view, SimpleNamespace(name="fast"), now=12.0) == []


def test_the_hello_names_the_smallest_models_first(handle):
    sizes = {"big:1": 1 << 30, "small:1": 1 << 10, "stage:1": 0, "gone:1": None}
    specs = [ModelSpec(name=k.split(":")[0], version="1", path="", inputs=[], outputs=[]) for k in sizes]
    registry = SimpleNamespace(
        startup_specs=lambda: specs,
        record=lambda key: None if sizes[key] is None else SimpleNamespace(param_bytes=lambda: sizes[key]))
    handle.spawned(None)
    answer = Handshake(registry).hello(handle, WorkerHello(v=PROTOCOL_VERSION, worker_id=0, pid=1), 5.0)
    assert [s.name for s in answer.models] == ["stage", "gone", "small", "big"]   # stable among equals
    # each waits its turn, and status says so until its loader tells the load began
    assert {k: (u.phase, u.since) for k, u in handle.under_way.items()} == {k: ("queued", 5.0) for k in sizes}


def test_a_start_up_model_in_is_served_and_counted_once_on_its_record(handle):
    rec = SimpleNamespace(seen=False)
    rec.served_by = lambda nbytes, footprint: setattr(rec, "seen", True)
    shake = Handshake(SimpleNamespace(record=lambda key: rec))
    handle.spawned(None)
    assert not shake.model_loaded(handle, ModelLoaded(worker_id=0, key="m:1", error="x", startup=True))
    assert shake.model_loaded(handle, ModelLoaded(worker_id=0, key="m:1", bytes=8, startup=True))
    assert rec.seen and handle.offers("m:1")
    handle.became_ready(["m:1"])
    assert not shake.model_loaded(handle, ModelLoaded(worker_id=0, key="m:1", startup=True))   # not starting now


# ---- the printed lines -----------------------------------------------------------------------

class Terminal(io.StringIO):
    def __init__(self, tty: bool, encoding: str = "utf-8"):
        super().__init__()
        self.tty, self._encoding = tty, encoding

    def isatty(self) -> bool:
        return self.tty

    @property
    def encoding(self) -> str:
        return self._encoding


@pytest.mark.parametrize("tty, setting, log_format, printed", [
    (True, None, "text", True), (False, None, "text", False), (True, None, "json", False),
    (False, "on", "json", True), (False, "1", "text", True), (True, "off", "text", False), (True, "0", "text", False),
    (True, "AUTO", "text", True)])
def test_printed_on_a_terminal_in_text_mode_unless_forced(tty, setting, log_format, printed):
    assert wanted(Terminal(tty), setting, log_format) is printed


def test_a_bad_setting_is_named_and_auto_used(caplog):
    caplog.set_level(logging.WARNING, logger="tgw.broker")
    assert wanted(Terminal(True), "sometimes", "text")
    assert "TGW_PROGRESS='sometimes' is not one of on, off, auto" in caplog.text


def test_one_line_per_phase():
    out = Terminal(True)
    lines = ProgressLines(out, enabled=True)
    lines.moved("worker0[cpu]", "resnet:1", "loading", 0.0)
    lines.moved("worker0[cpu]", "resnet:1", "warming", 11.1)
    lines.ready("worker0[cpu]", "resnet:1", 11.1, 1.2)
    lines.failed("worker1[cpu]", "bert:1", 0.25, "RuntimeError: no\nTraceback ...")
    lines.failed("worker1[cpu]", "<preload>", None, "preload 'x' failed")
    assert out.getvalue().splitlines() == [
        "  resnet:1 on worker0[cpu]  loading…",
        "  resnet:1 on worker0[cpu]  warming up… (loaded in 11.1 s)",
        "  resnet:1 on worker0[cpu]  ready in 12.3 s (load 11.1 s, warm-up 1.2 s)",
        "  bert:1 on worker1[cpu]  failed after 250 ms: RuntimeError: no (the log has the whole error)",
        "  <preload> on worker1[cpu]  failed: preload 'x' failed (the log has the whole error)"]
    assert took(0.0412) == "41 ms" and took(12.34) == "12.3 s"


def test_off_prints_nothing_and_a_closed_stream_turns_it_off():
    out = Terminal(True)
    ProgressLines(out, enabled=False).moved("w", "m:1", "loading", 0.0)
    assert out.getvalue() == ""
    ascii_only = ProgressLines(Terminal(True, encoding="ascii"), enabled=True)
    ascii_only.moved("w", "m:1", "loading", 0.0)
    assert ascii_only.stream.getvalue() == "  m:1 on w  loading...\n"
    ascii_only.stream.close()
    ascii_only.ready("w", "m:1", 1.0, 1.0)   # no exception: the broker goes on
    assert not ascii_only.enabled
