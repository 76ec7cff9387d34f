"""GcWatch (shm/gc_watch.py): every collection timed and counted by generation, freeze() moves
the live heap to the permanent generation without its own collection counting as a pause, the
figures' shape, reset_longest. (In a running broker: tests/process/test_status.py.)"""
from __future__ import annotations

import gc

import pytest

from tgw.shm.gc_watch import GcWatch


@pytest.fixture
def fresh():
    w = GcWatch().install()
    gc.disable()   # only the test's own collections, so the counts are exact
    yield w
    gc.enable()
    w.uninstall()
    gc.unfreeze()


def test_a_forced_collection_is_timed_and_counted(fresh):
    before = dict(fresh.as_dict()["collections"])
    junk = [[i] for i in range(20_000)]   # something for the full collection to walk
    gc.collect()
    del junk
    d = fresh.as_dict()
    assert d["collections"]["2"] == before["2"] + 1
    assert d["last_pause_ms"] > 0 and d["longest_pause_ms"] >= d["last_pause_ms"]
    fresh.reset_longest()
    assert fresh.as_dict()["longest_pause_ms"] == 0 and fresh.as_dict()["pauses_over_1ms"] == 0
    gc.collect(0)
    assert fresh.as_dict()["collections"]["0"] == before["0"] + 1


def test_freeze_moves_the_heap_out_and_is_not_a_pause(fresh):
    assert fresh.as_dict()["frozen"] is False
    gc.unfreeze()
    gc.collect()                                # a start-up pause ...
    assert fresh.longest_ns > 0
    full = fresh.collections[2]
    fresh.freeze()
    d = fresh.as_dict()
    assert d["frozen"] is True and gc.get_freeze_count() > 0 and d["frozen_objects"] == gc.get_freeze_count()
    assert fresh.collections[2] == full + 1     # its collection is counted ...
    assert d["longest_pause_ms"] == 0           # ... but pauses count from the freeze on: serving's only


def test_collect_all_reaches_the_frozen_heap_and_freezes_again(fresh):
    class Node:
        pass
    a, b = Node(), Node()
    a.other, b.other = b, a                     # a cycle, frozen with the start-up heap
    fresh.freeze()
    gc.collect()
    longest = fresh.longest_ns
    del a, b
    gc.collect()                                # a plain collection never walks the frozen cycle
    assert any(type(o) is Node for o in gc.get_objects(generation=None) + _frozen())
    fresh.collect_all()
    assert not any(type(o) is Node for o in gc.get_objects() + _frozen())
    assert fresh.frozen and gc.get_freeze_count() > 0 and fresh.longest_ns == longest   # not a pause


def _frozen() -> list:
    """The permanent generation's objects (gc.get_objects does not list them)."""
    gc.unfreeze()
    objs = gc.get_objects()
    gc.freeze()
    return objs


def test_shape_and_idempotent_install(fresh):
    fresh.install()
    assert gc.callbacks.count(fresh._on_gc) == 1
    d = fresh.as_dict()
    assert set(d) == {"frozen", "frozen_objects", "longest_pause_ms", "last_pause_ms", "collections",
                      "pauses_over_1ms"}
    assert set(d["collections"]) == {"0", "1", "2"}
    fresh.uninstall()
    assert fresh._on_gc not in gc.callbacks
