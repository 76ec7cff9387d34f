"""Sequence batching's bindings (broker/sequence/binding.py), pure, under an injected clock, with
the real batcher: the checks at admission and their errors, binding to the lowest free slot, at
most one request of a sequence per batch in its order, only on its worker, idle expiry, restart,
the end flag, a worker's death and what is remembered of ended sequences."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from batcher_cases import BIG, req
from fake_clock import Clock
from tgw.broker.sched.batcher import Batcher
from tgw.broker.sequence.binding import Sequences
from tgw.shm.errors import TgwError
from tgw.shm.wire import GenerateParams, Infer, ModelLoaded, SequenceRef, TensorMeta

pytestmark = pytest.mark.unit
KEY = "acc:1"


def entry(name="acc", kind="uint64", slots=2):
    sb = SimpleNamespace(max_sequences=slots, max_sequence_idle_us=1_000_000, correlation_id=kind)
    return SimpleNamespace(name=name, decl=SimpleNamespace(sequence_batching=sb, max_batch_size=8))


def worker(n: int):
    return SimpleNamespace(identity=f"w{n}.1".encode(), name=f"worker{n}[cpu]", last_death="killed by signal 9")


class Rig:
    def __init__(self, slots=2, remember=65536):
        self.clock = Clock()
        self.models = {"acc": entry(slots=slots), "plain": SimpleNamespace(name="plain", decl=SimpleNamespace(
            sequence_batching=None))}
        self.seqs = Sequences(self.models, self.clock, remember)
        self.batcher = Batcher(self.clock)
        self.batcher.add_model("acc", 8, 64, levels=3)

    def msg(self, cid, start=False, end=False, model="acc", priority=0, **more) -> Infer:
        seq = None if cid is None else SequenceRef(id=cid, start=start, end=end)
        return Infer(v=2, id=1, model=model, priority=priority, sequence=seq,
                     inputs=[TensorMeta(name="x", dtype="float32", shape=[1, 1])], **more)

    def admit(self, cid, start=False, end=False, priority=0):
        """As admission does: check, take the sequence's level, queue, commit."""
        ticket = self.seqs.check(self.models["acc"], self.msg(cid, start, end), 1)
        p = req(model="acc", clock=self.clock)
        p.priority = priority if ticket.priority is None else ticket.priority
        self.batcher.push(p)
        self.seqs.admitted(p, ticket, self.clock())
        return p

    def refused(self, cid, start=False, end=False, model="acc", rows=1, **more) -> str:
        with pytest.raises(TgwError) as info:
            self.seqs.check(self.models[model], self.msg(cid, start, end, model=model, **more), rows)
        assert info.value.code.value == "INVALID_ARGUMENT"
        return info.value.message

    def dispatch(self, w) -> list:
        """One batch to `w` as the pump forms it: [(corrid, slot, start, end)]."""
        if not self.batcher.queued("acc"):
            return []
        batch = self.batcher.next_batch("acc", BIG, None, self.clock(), None, self.seqs.chooser(w, KEY))
        if not batch:
            return []
        for p in batch:
            p.dispatch(self.clock())
        self.last = batch
        return [(s.corrid, s.slot, s.start, s.end) for s in self.seqs.dispatched(w, KEY, batch)]

    def done(self, batch=None) -> None:
        self.seqs.exits(self.last if batch is None else batch, None, self.clock())


def test_interleaved_sequences_bind_to_the_lowest_free_slots_one_step_a_batch_in_order():
    r, w = Rig(), worker(1)
    for cid, start, end in [(7, True, False), (9, True, False), (7, False, False), (9, False, False),
                            (7, False, True), (9, False, False)]:
        r.admit(cid, start, end)
    assert r.dispatch(w) == [(7, 0, True, False), (9, 1, True, False)]
    assert r.dispatch(w) == [(7, 0, False, False), (9, 1, False, False)]   # staged behind: same worker, in order
    assert r.dispatch(w) == [(7, 0, False, True), (9, 1, False, False)]
    c = r.seqs.of("acc")
    assert (c.live, c.started, c.steps, c.misrouted) == (2, 2, 6, 0)
    r.done()   # 7's end answered: its slot is free, the lowest again
    assert c.live == 1 and dict(c.ended) == {"end": 1}
    r.admit(11, start=True)
    assert r.dispatch(w) == [(11, 0, True, False)]
    assert "ended: its request with sequence_end was answered" in r.refused(7)


def test_a_bound_sequence_runs_only_on_its_worker_and_starts_wait_for_a_free_slot():
    r, w1, w2 = Rig(slots=1), worker(1), worker(2)
    a = r.admit(1, start=True)
    r.admit(2, start=True)
    assert r.dispatch(w1) == [(1, 0, True, False)]   # one slot: the second start waits
    r.admit(1)
    head = r.batcher.head("acc")
    assert r.seqs.can_run(head, w2, KEY) and not r.seqs.can_run(head, w1, KEY)   # a start: any free slot
    assert r.dispatch(w2) == [(2, 0, True, False)]
    head = r.batcher.head("acc")
    assert head.sequence.seq.corrid == 1 and not r.seqs.can_run(head, w2, KEY) and r.seqs.can_run(head, w1, KEY)
    assert r.dispatch(w2) == [] and r.dispatch(w1) == [(1, 0, False, False)]
    r.done([a])
    assert r.seqs.of("acc").live == 2   # a start's answer ends nothing


def test_a_sequence_keeps_its_start_level_and_a_skipped_step_holds_back_the_next():
    r, w = Rig(slots=1), worker(1)
    r.admit(1, start=True, priority=2)
    assert r.admit(1, priority=0).priority == 2   # its start's level: FIFO there is its order
    r.admit(2, start=True, priority=0)
    # 2's start finds no slot left by 1's start; 1's second step waits for the next batch
    assert r.dispatch(w) == [(2, 0, True, False)]
    assert r.dispatch(w) == []   # no free slot on w for 1's start


def test_the_checks_refuse_with_the_words_triton_uses():
    r = Rig()
    assert "must specify a non-zero or non-empty correlation ID" in r.refused(None)
    assert "does not take sequence batching requests" in r.refused(5, start=True, model="plain")
    assert r.seqs.check(r.models["plain"], r.msg(None, model="plain"), 4) is None
    assert "uint64 correlation IDs" in r.refused("abc", start=True)
    assert "one row" in r.refused(5, start=True, rows=2)
    assert "does not generate" in r.refused(5, start=True, generate=GenerateParams())
    assert "must specify the START flag on the first request of the sequence: no sequence" in r.refused(5)
    assert r.seqs.of("acc").refused == 5   # the plain model's refusal is not a sequence model's
    strings = Sequences({"s": entry("s", kind="string")}, Clock())
    with pytest.raises(TgwError, match="string correlation IDs"):
        strings.check(strings.models["s"], Infer(v=2, id=1, model="s", inputs=[], sequence=SequenceRef(id=3)), 1)
    # "any" (a Triton model without a CORRID control): uint64 and string ids alike, each its own sequence
    either = Sequences({"e": entry("e", kind="any")}, Clock())
    for cid in (7, "7"):
        assert either.check(either.models["e"], Infer(v=2, id=1, model="e", inputs=[],
                                                      sequence=SequenceRef(id=cid, start=True)), 1) is not None
    for cid in (0, ""):
        with pytest.raises(TgwError, match="uint64 .* or non-empty string correlation IDs"):
            either.check(either.models["e"], Infer(v=2, id=1, model="e", inputs=[], sequence=SequenceRef(id=cid)), 1)


def test_an_idle_sequence_ends_frees_its_slot_and_says_so_while_a_busy_one_stays():
    r, w = Rig(), worker(1)
    r.admit(1, start=True)
    r.admit(2, start=True)
    r.dispatch(w)
    r.done()
    r.admit(2)    # queued: not idle however long it waits
    r.clock.t += 0.5
    r.seqs.sweep(r.clock())
    assert r.seqs.of("acc").live == 2
    r.clock.t += 0.6
    r.seqs.sweep(r.clock())
    c = r.seqs.of("acc")
    assert c.live == 1 and dict(c.ended) == {"idle": 1}
    said = r.refused(1)
    assert "no request for 1 s (sequence_batching.max_sequence_idle_us 1000000)" in said and "sequence_start" in said
    r.admit(3, start=True)
    assert r.dispatch(w) == [(2, 1, False, False), (3, 0, True, False)]   # 1's slot went to 3
    r.admit(1, start=True)   # an ended id starts again
    assert r.dispatch(w) == [] and r.seqs.table[("acc", 1)].slot is None   # no slot free yet


def test_a_start_for_a_live_id_restarts_it_on_its_slot():
    r, w = Rig(), worker(1)
    r.admit(4, start=True)
    r.dispatch(w)
    r.admit(4, start=True)
    assert r.dispatch(w) == [(4, 0, True, False)]
    assert r.seqs.of("acc").started == 2 and r.seqs.of("acc").live == 1


def test_an_end_never_run_leaves_the_sequence_live_and_a_start_never_run_ends_it():
    r, w = Rig(), worker(1)
    r.admit(1, start=True)
    r.dispatch(w)
    end = r.admit(1, end=True)
    assert "already queued or running" in r.refused(1)
    r.batcher.remove(end)
    r.seqs.exits([end], "CANCELLED", r.clock())   # withdrawn before it ran
    r.admit(1)   # the sequence goes on
    start = r.admit(2, start=True)
    r.batcher.remove(start)
    r.seqs.exits([start], "DEADLINE_EXCEEDED", r.clock())
    assert "its start request was not run (DEADLINE_EXCEEDED)" in r.refused(2)
    r.admit(3, start=True)
    assert r.dispatch(w) == [(1, 0, False, False), (3, 1, True, False)]
    r.last[1].take_back()   # withdrawn from its batch on the worker: it never ran, its slot holds no state of 3
    r.done()
    assert "its start request was not run (withdrawn)" in r.refused(3) and r.seqs.of("acc").live == 1


def test_a_dead_workers_sequences_end_their_queued_steps_are_answered_and_later_ones_told():
    r, w1, w2 = Rig(), worker(1), worker(2)
    r.admit(1, start=True)
    r.dispatch(w1)
    r.done()
    r.admit(5, start=True)
    r.dispatch(w2)
    r.done()
    queued = r.admit(1)
    r.admit(5)
    r.seqs.lost(w1)
    assert r.seqs.orphans
    orphans = r.batcher.take_where(r.seqs.orphaned)
    assert orphans == [queued]
    err = r.seqs.orphan_error(queued)
    assert err.code.value == "WORKER_DIED" and not err.retryable and "its worker died (worker1[cpu]" in err.message
    assert "its worker died" in r.refused(1)
    c = r.seqs.of("acc")
    assert dict(c.ended) == {"worker_died": 1} and c.live == 1 and c.slots == 2   # w2's pool only
    assert r.dispatch(w2) == [(5, 0, False, False)]
    start, mid = r.admit(8, start=True), r.admit(5)
    assert r.seqs.death_error(w2, start).retryable and not r.seqs.death_error(w2, mid).retryable


def test_slots_follow_the_worker_and_the_remembered_ids_are_bounded():
    r, w = Rig(slots=1, remember=2), worker(1)
    assert r.seqs.loaded(w, ModelLoaded(worker_id=1, key=KEY, slots=3)) and r.seqs.of("acc").slots == 3
    assert not r.seqs.loaded(w, ModelLoaded(worker_id=1, key="plain:1", slots=4))   # not a sequence model: not the wing's
    for cid in (1, 2, 3):
        r.admit(cid, start=True, end=True)
    assert r.dispatch(w) == [(1, 0, True, True), (2, 1, True, True), (3, 2, True, True)]
    r.done()
    assert list(r.seqs.ended) == [("acc", 2), ("acc", 3)]
    assert "no sequence of that id was started" in r.refused(1)


def test_a_version_its_worker_no_longer_holds_takes_its_sequences_along():
    r, w1, w2 = Rig(), worker(1), worker(2)
    r.admit(1, start=True)
    r.dispatch(w1)
    r.admit(2, start=True)
    r.dispatch(w2)
    r.done()
    queued = r.admit(1)
    r.seqs.held(lambda ident, key: ident != w1.identity)   # w1 unloaded acc:1
    assert r.batcher.take_where(r.seqs.orphaned) == [queued]
    assert "its version acc:1 was unloaded from its worker" in r.seqs.orphan_error(queued).message
    c = r.seqs.of("acc")
    assert dict(c.ended) == {"unloaded": 1} and c.live == 1 and c.slots == 2 and "unloaded" in r.refused(1)


def test_a_step_naming_another_version_than_its_sequences_is_refused():
    r = Rig()
    r.admit(1, start=True)
    ticket = r.seqs.check(r.models["acc"], r.msg(1), 1)
    r.seqs.on_version(ticket, r.msg(1))   # named none: it goes to the sequence's version
    with pytest.raises(TgwError, match="runs on version '1', which holds its state"):
        r.seqs.on_version(ticket, r.msg(1, version="2"))


def test_a_start_waiting_for_a_slot_or_a_busy_worker_holds_back_no_other_sequence():
    r, w1, w2 = Rig(slots=1), worker(1), worker(2)
    r.admit(1, start=True)
    assert r.dispatch(w1) == [(1, 0, True, False)]
    r.admit(2, start=True)
    assert r.dispatch(w2) == [(2, 0, True, False)]
    r.admit(3, start=True)   # no slot left anywhere: waits at the head
    r.admit(1)
    r.admit(2)
    r.admit(1, end=True)
    assert r.batcher.head("acc").sequence.seq.corrid == 3
    assert r.dispatch(w2) == [(2, 0, False, False)]   # behind the waiting start, on its own worker
    assert r.dispatch(w1) == [(1, 0, False, False)]
    assert r.dispatch(w1) == [(1, 0, False, True)]
    assert r.dispatch(w1) == []   # 1's slot is freed only when its end is answered
    r.done()
    assert r.dispatch(w1) == [(3, 0, True, False)] and r.batcher.queued("acc") == 0
    assert r.seqs.of("acc").misrouted == 0
