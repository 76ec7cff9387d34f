"""Sequence batching, the broker's side (docs/SEQUENCES.md): the one writer of which sequence
holds which worker and state slot. Pure: an injected clock, no sockets.

* Admission (`check`, then `admitted` once the request is queued): a sequence model's request
  names its sequence (Triton's correlation id, of the model's kind), one row, no `generate`; a
  non-start request names a live sequence, else the error says why (never started, ended by its
  end flag, idle, lost with its worker). Every request of a sequence takes its start's priority
  level, so the level's FIFO order is the sequence's order.
* Dispatch: the pump offers a head to a worker that may run it first - its sequence's worker,
  or (a start) one with a free slot (`can_run`) - then to the others; a batch to a worker takes
  the queued requests that may run there, in queue order: at most one of a sequence, none
  behind one of its own left waiting, bound ones only there, starts only into its free slots
  (`chooser`, the batcher's `fits`); what cannot run waits without holding back the rest;
  `dispatched` binds starts to the lowest free slot and gives each request its SeqStep.
* End: a dispatched request with the end flag frees the slot when it leaves (its batch's Done);
  a sequence with nothing queued or running for max_sequence_idle_us ends at the next sweep; a
  dead worker's sequences end, and those of a version its worker no longer holds (`held`). Ended ids are remembered (a bounded LRU) with why, for the error
  a later request gets; requests still queued for an ended sequence are the core's to answer
  (`orphaned`, `orphan_error`).
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Callable

from tgw.shm.errors import Code, TgwError, fail
from tgw.shm.wire import SeqStep, split_model_key

from .counters import SequenceCounters

REMEMBER = 65536   # ended sequences whose ids are remembered, for a clear error
U64 = 1 << 64
END, IDLE, WORKER_DIED, UNLOADED = "end", "idle", "worker_died", "unloaded"


class Seq:
    """One life of a sequence, from its start to its end."""
    __slots__ = ("model", "corrid", "priority", "version", "worker", "key", "slot", "last_use", "outstanding",
                 "closing", "began", "ended")

    def __init__(self, model: str, corrid, priority: int, version: str, now: float):
        self.model, self.corrid, self.priority, self.version = model, corrid, priority, version
        self.worker: bytes | None = None   # the identity of the worker life holding its slot
        self.key: str | None = None
        self.slot: int | None = None
        self.last_use = now
        self.outstanding = 0               # its requests admitted and not yet answered
        self.closing = False               # its end request is admitted: only a start may follow
        self.began = False                 # a start of it ran on its worker (its slot's state is its own)
        self.ended: tuple | None = None    # (reason, text) once it ended


class Step:
    """A request's part in its sequence (Pending.sequence)."""
    __slots__ = ("seq", "start", "end")

    def __init__(self, seq: Seq, start: bool, end: bool):
        self.seq, self.start, self.end = seq, start, end


class Ticket:
    """What `check` found: the sequence a request steps (None: a start of a new one)."""
    __slots__ = ("seq", "ref", "priority", "version")

    def __init__(self, seq: Seq | None, ref, priority: int | None, version: str | None):
        self.seq, self.ref, self.priority, self.version = seq, ref, priority, version


class SlotPool:
    """One worker life's slots of one version: the lowest free one is taken first."""
    __slots__ = ("size", "free", "taken")

    def __init__(self, size: int):
        self.size, self.free, self.taken = size, list(range(size)), set()

    def take(self) -> int:
        slot = heapq.heappop(self.free)
        self.taken.add(slot)
        return slot

    def give(self, slot: int) -> None:
        if slot in self.taken:
            self.taken.discard(slot)
            if slot < self.size:
                heapq.heappush(self.free, slot)

    def resize(self, size: int) -> None:
        self.size = size
        self.free = [s for s in range(size) if s not in self.taken]


class Sequences:
    def __init__(self, models: dict, clock: Callable[[], float], remember: int = REMEMBER):
        """`models`: the registry's entries by name (models/entry.py ModelEntry)."""
        self.models, self.clock, self.remember = models, clock, remember
        self.table: dict[tuple, Seq] = {}             # (model, corrid) -> its live life
        self.idle: dict[str, OrderedDict] = {}        # model -> live sequences, least recently used first
        self.ended: OrderedDict = OrderedDict()       # (model, corrid) -> (reason, text), the latest last
        self.pools: dict[tuple, SlotPool] = {}        # (worker identity, key) -> its slots
        self.counters: dict[str, SequenceCounters] = {}
        self.orphans = False                          # an ended sequence may have requests queued

    def of(self, model: str) -> SequenceCounters:
        c = self.counters.get(model)
        if c is None:
            c = self.counters[model] = SequenceCounters()
        return c

    # ---- admission ----------------------------------------------------------------------------

    def check(self, entry, msg, rows: int) -> Ticket | None:
        """The request's Ticket (None: a plain request of a plain model); raises the TgwError
        that refuses it. `entry`: its model (ModelEntry); `msg`: its Infer."""
        decl, ref, name = entry.decl.sequence_batching, msg.sequence, entry.name
        if decl is None:
            if ref is None:
                return None
            raise fail(Code.INVALID_ARGUMENT, f"model {name!r} does not take sequence batching requests (no "
                       "sequence_batching in its config)", reason="not_a_sequence_model", model=name)
        try:
            return self._check(entry, decl, msg, ref, rows)
        except TgwError:
            self.of(name).refused += 1
            raise

    def _check(self, entry, decl, msg, ref, rows: int) -> Ticket:
        name = entry.name
        if ref is None:
            raise fail(Code.INVALID_ARGUMENT, f"inference request to model {name!r} must specify a non-zero or "
                       "non-empty correlation ID", reason="sequence_id_missing", model=name)
        cid = ref.id
        if decl.correlation_id == "string":
            if type(cid) is not str or not cid:
                raise fail(Code.INVALID_ARGUMENT, f"model {name!r} takes string correlation IDs "
                           f"(sequence_batching.correlation_id), got {cid!r}", reason="sequence_id_kind", model=name)
        elif decl.correlation_id == "any":
            if not ((type(cid) is str and cid) or (type(cid) is int and 0 < cid < U64)):
                raise fail(Code.INVALID_ARGUMENT, f"model {name!r} takes uint64 (1 .. 2**64-1) or non-empty string "
                           f"correlation IDs, got {cid!r}", reason="sequence_id_kind", model=name)
        elif type(cid) is not int or not 0 < cid < U64:
            raise fail(Code.INVALID_ARGUMENT, f"model {name!r} takes uint64 correlation IDs (1 .. 2**64-1; "
                       f"sequence_batching.correlation_id), got {cid!r}", reason="sequence_id_kind", model=name)
        if msg.generate is not None:
            raise fail(Code.INVALID_ARGUMENT, f"model {name!r} is a sequence model: a request steps a sequence, it "
                       "does not generate (no `generate`)", reason="sequence_generate", model=name)
        if rows != 1:
            raise fail(Code.INVALID_ARGUMENT, f"a request of sequence {cid!r} steps it once: its inputs have one row "
                       f"(batch dim 1), not {rows}", reason="sequence_rows", rows=rows, model=name)
        seq = self.table.get((name, cid))
        if seq is not None and seq.closing:
            seq = None   # its end is admitted: a start begins a new life, anything else is refused
        if ref.start:   # a start for a live id restarts it on its slot (the worker resets the state)
            return Ticket(seq, ref, None if seq is None else seq.priority, None if seq is None else seq.version)
        if seq is None:
            raise self.unknown(name, cid)
        return Ticket(seq, ref, seq.priority, seq.version)

    def on_version(self, ticket: Ticket, msg) -> None:
        """A request whose routing picked another version than its sequence's: refused when it named
        that version (its state is on the other), else it goes to the sequence's."""
        if msg.version is not None:
            self.of(msg.model).refused += 1
            raise fail(Code.INVALID_ARGUMENT, f"sequence {ticket.ref.id!r} of model {msg.model!r} runs on version "
                       f"{ticket.version!r}, which holds its state: name that version or none (or end the sequence and "
                       f"start it again on {msg.version!r})", reason="sequence_version", model=msg.model,
                       version=ticket.version)

    def unknown(self, model: str, cid) -> TgwError:
        """The error for a non-start request of a sequence that is not live (Triton's words first)."""
        why = self.ended.get((model, cid))
        live = self.table.get((model, cid))
        if why is None and live is not None and live.closing:
            why = (END, "its request with sequence_end is already queued or running")
        text = f"inference request for sequence {cid!r} to model {model!r} must specify the START flag on the " \
               "first request of the sequence"
        if why is None:
            return fail(Code.INVALID_ARGUMENT, text + ": no sequence of that id was started (or it ended long "
                        "ago)", reason="sequence_unknown", model=model, sequence_id=cid)
        return fail(Code.INVALID_ARGUMENT, f"{text}: the sequence ended: {why[1]}; send a request with "
                    "sequence_start to begin it again", reason="sequence_ended", ended_by=why[0], model=model,
                    sequence_id=cid)

    def admitted(self, p, ticket: Ticket, now: float) -> None:
        """`p` is queued: it steps its sequence (a start of a new one makes it live)."""
        ref, seq = ticket.ref, ticket.seq
        key = (p.model, ref.id)
        if seq is None:
            seq = self.table[key] = Seq(p.model, ref.id, p.priority, p.version, now)
            self.ended.pop(key, None)
        if ref.start:
            self.of(p.model).started += 1
        seq.outstanding += 1
        seq.closing = seq.closing or ref.end
        self._used(seq, now)
        p.sequence = Step(seq, ref.start, ref.end)

    def _used(self, seq: Seq, now: float) -> None:
        seq.last_use = now
        lru = self.idle.setdefault(seq.model, OrderedDict())
        lru[seq] = None
        lru.move_to_end(seq)

    # ---- dispatch (the core's pump) -----------------------------------------------------------

    def pool(self, w, key: str) -> SlotPool:
        pool = self.pools.get((w.identity, key))
        if pool is None:   # a worker that did not say: the declared pool, else one batch's worth
            decl = self.models[split_model_key(key)[0]].decl
            pool = self._sized(w.identity, key, decl.sequence_batching.max_sequences or decl.max_batch_size)
        return pool

    def can_run(self, head, w, key: str) -> bool:
        """Whether worker `w` may run `head` (a sequence request): its sequence's worker, or (a
        sequence not yet bound) a worker with a free slot of `key`."""
        seq = head.sequence.seq
        if seq.slot is not None:
            return seq.worker == w.identity and seq.key == key
        return bool(self.pool(w, key).free)

    def chooser(self, w, key: str) -> Callable:
        """The batcher's `fits(p, ok)` for one batch of `key` to `w`, shown every request it scans in
        queue order: at most one request of a sequence (and none after one skipped), bound ones
        only of `w`, unbound ones only up to `w`'s free slots. What it refuses keeps its place and
        does not hold back the other sequences behind it (no head-of-line blocking)."""
        seen: set = set()
        free = [len(self.pool(w, key).free)]
        ident, version = w.identity, split_model_key(key)[1]

        def fits(p, ok: bool) -> bool:
            step = p.sequence
            if step is None:
                return ok
            seq = step.seq
            if seq in seen:
                return False
            seen.add(seq)
            if not ok or seq.ended is not None or p.version != version:
                return False
            if seq.slot is not None:
                return seq.worker == ident and seq.key == key
            if free[0] > 0:
                free[0] -= 1
                return True
            return False
        return fits

    def dispatched(self, w, key: str, ps: list) -> list[SeqStep]:
        """A batch of `key` goes to `w`: its unbound sequences take the lowest free slots; each
        request's SeqStep, in order (Batch.steps)."""
        steps, c = [], self.of(ps[0].model)
        pool = self.pool(w, key)
        for p in ps:
            step = p.sequence
            seq = step.seq
            if seq.slot is None:
                seq.worker, seq.key, seq.slot = w.identity, key, pool.take()
                c.live += 1
            elif seq.worker != w.identity:   # never: can_run and the chooser forbid it
                c.misrouted += 1
            c.steps += 1
            steps.append(SeqStep(slot=seq.slot, corrid=seq.corrid, start=step.start, end=step.end))
        return steps

    # ---- slots and workers --------------------------------------------------------------------

    def loaded(self, w, msg) -> bool:
        """A load ended on `w`: a sequence model's slot pool (True), else not this wing's (False)."""
        entry = self.models.get(split_model_key(msg.key)[0])
        if entry is None or entry.decl.sequence_batching is None:
            return False
        if msg.error is None and msg.slots:
            self._sized(w.identity, msg.key, msg.slots)
        return True

    def _sized(self, ident: bytes, key: str, size: int) -> SlotPool:
        pool = self.pools.get((ident, key))
        if pool is None:
            pool = self.pools[ident, key] = SlotPool(size)
        elif pool.size != size:
            pool.resize(size)
        self._recount(split_model_key(key)[0])
        return pool

    def _recount(self, model: str) -> None:
        self.of(model).slots = sum(p.size for (_, key), p in self.pools.items() if split_model_key(key)[0] == model)

    def lost(self, w) -> None:
        """`w`'s process is gone, and with it the state of every sequence it held."""
        ident = w.identity
        for seq in [s for s in self.table.values() if s.worker == ident]:
            self._end(seq, WORKER_DIED, f"its worker died ({w.name}: {w.last_death or 'exited'}) and its state "
                      "with it")
        for pk in [pk for pk in self.pools if pk[0] == ident]:
            model = split_model_key(pk[1])[0]
            del self.pools[pk]
            self._recount(model)

    def held(self, holds: Callable[[bytes, str], bool]) -> None:
        """End the sequences of every pool whose worker no longer holds its version (`holds(worker
        identity, key)`: unloaded, evicted, rolled out): their state went with it."""
        for ident, key in [pk for pk in self.pools if not holds(*pk)]:
            for seq in [s for s in self.table.values() if s.worker == ident and s.key == key]:
                self._end(seq, UNLOADED, f"its version {key} was unloaded from its worker, and its state with it")
            del self.pools[ident, key]
            self._recount(split_model_key(key)[0])

    def death_error(self, w, p) -> TgwError:
        """The answer to a sequence request in flight on a worker that died: never run elsewhere
        (its state is gone); a start may be sent again."""
        step = p.sequence
        return fail(Code.WORKER_DIED, f"{w.name} died while running this request of sequence {step.seq.corrid!r} "
                    f"of model {p.model!r} ({w.last_death}): the sequence's state is gone; start it again",
                    retryable=step.start, sequence_id=step.seq.corrid, model=p.model)

    # ---- ends ---------------------------------------------------------------------------------

    def exits(self, ps: list, code: str | None, now: float) -> None:
        """Requests leave (admission's exit hook): a dispatched end request frees its slot; an end
        never dispatched leaves the sequence live; a start that did not run (withdrawn, expired,
        left out by its worker) ends a sequence none of whose starts ran: its later requests have
        no state to step."""
        for p in ps:
            step = p.sequence
            if step is None:
                continue
            seq = step.seq
            seq.outstanding -= 1
            if seq.ended is not None:
                continue
            self._used(seq, now)
            ran = p.dispatched is not None
            if step.end and ran:
                self._end(seq, END, "its request with sequence_end was answered")
            elif step.end:
                seq.closing = False
            if step.start and ran:
                seq.began = True
            elif step.start and not seq.began and seq.ended is None:
                self._end(seq, END, f"its start request was not run ({code or 'withdrawn'})")

    def sweep(self, now: float) -> None:
        """End the sequences idle past their model's max_sequence_idle_us (nothing queued or running)."""
        for model, lru in self.idle.items():
            limit = self.models[model].decl.sequence_batching.max_sequence_idle_us / 1e6 \
                if model in self.models else 0.0
            for seq in list(lru):
                if seq.last_use + limit > now:
                    break
                if seq.outstanding == 0:
                    self._end(seq, IDLE, f"no request for {limit:g} s (sequence_batching.max_sequence_idle_us "
                              f"{round(limit * 1e6)})")

    def _end(self, seq: Seq, reason: str, text: str) -> None:
        seq.ended = (reason, text)
        key = (seq.model, seq.corrid)
        if self.table.get(key) is seq:
            del self.table[key]
            self.ended[key] = seq.ended
            self.ended.move_to_end(key)
            while len(self.ended) > self.remember:
                self.ended.popitem(last=False)
        lru = self.idle.get(seq.model)
        if lru is not None:
            lru.pop(seq, None)
        c = self.of(seq.model)
        c.ended[reason] += 1
        if seq.slot is not None:
            c.live -= 1
            pool = self.pools.get((seq.worker, seq.key))
            if pool is not None:
                pool.give(seq.slot)
        if seq.outstanding:
            self.orphans = True

    def orphaned(self, p) -> bool:
        """Whether queued `p` steps a sequence that ended (the core answers it `orphan_error`)."""
        return p.sequence is not None and p.sequence.seq.ended is not None

    def orphan_error(self, p) -> TgwError:
        seq = p.sequence.seq
        reason, text = seq.ended
        code = Code.WORKER_DIED if reason == WORKER_DIED else Code.INVALID_ARGUMENT
        return fail(code, f"sequence {seq.corrid!r} of model {seq.model!r} ended before this request ran: {text}; "
                    "send a request with sequence_start to begin it again", reason="sequence_ended", ended_by=reason,
                    sequence_id=seq.corrid, model=seq.model, retryable=False)

