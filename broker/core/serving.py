"""The broker's serving core: requests in the queues, batches to workers, workers' deaths.

Everything here runs as plain callbacks on one uvloop loop: one pump per loop turn forms
batches for workers with room (so a burst drained from the socket becomes one batch, not
many). It owns routing to workers (the roster it reads is the supervisor's), the batch
sequence and the back socket; queues live in batcher, checks in admission, the clients' side
in frontdoor, what workers send in WorkerMessages (below), the worker handshake in handshake,
versions on workers in placement, the answers no worker gives in unserved. The phase is its
own small part (phase.py), which the lifecycle alone moves.

What workers send on the back socket (WorkerMessages), one handler per message type:
completions answer their requests (those a stage failed, Done.failed, with their errors) and
feed the stats and the cost model; a withdrawn request (state/inflight.py) is never answered,
and counted by where it was: "staged" when the worker took it out before launch, "computing"
when its batch had launched (its rows dropped); heartbeats feed the memory watch and the
breakers; the handshake's messages go to fleet/handshake.py, a sticky CUDA error's to
fleet/faults.py, the loader thread's to models/placement.py. A load's phases (LoadPhase) and
its end are noted on its worker (status reads them) and printed by observe/progress.py; a
start-up model's ModelLoaded goes to the handshake (it serves before its worker is ready), a
failed start-up stops its worker.

A generator's requests (docs/GENERATION.md) take the same path to their worker; the generate
wing (`streams`, broker/generate/streams.py) holds them from there: the pump sends a worker no
more of them than its free slots (`room`), the admission batch's Done hands them to the wing
instead of answering them, each Steps message of a worker's loop goes to it, and a dead worker's
running sequences come back from it to the front of their queue.

A sequence model's requests (docs/SEQUENCES.md) ask the sequence wing (`sequences`,
broker/sequence/binding.py), which binds each sequence to a worker and slot: the pump sends a
head only to a worker that may run it and lets a batch take what the wing's chooser allows, the
staged batch gets its steps, the tick ends idle sequences, a dead worker's sequences end (their
requests answered, never run elsewhere) and requests queued for an ended sequence are answered.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

from tgw.shm.errors import Code, error_from_body, fail
from tgw.shm.wire import DecodeError, Done, Heartbeat, LoadPhase, ModelLoaded, Release, Steps, Stop, WorkerFailed, \
    WorkerFault, WorkerHello, WorkerReady, WorkerSnapshot, from_worker_decoder, model_key

from tgw.broker.fleet.faults import CudaFaults
from tgw.broker.fleet.handshake import Handshake, death_error
from tgw.broker.fleet.memory import MemoryWatch
from tgw.broker.fleet.worker_link import WorkerLink
from tgw.broker.front.frontdoor import FrontDoor
from tgw.broker.generate.streams import Streams
from tgw.broker.models.placement import Placement
from tgw.broker.models.registry import Registry
from tgw.broker.models.replay import ReplayRecorder
from tgw.broker.observe.progress import ProgressLines
from tgw.broker.sched.admission import Admission
from tgw.broker.sched.alarm import Alarm
from tgw.broker.sched.batcher import Batcher
from tgw.broker.sched.costmodel import CostModel
from tgw.broker.sched.unserved import Unserved
from tgw.broker.sequence.binding import Sequences
from tgw.broker.state.inflight import Gone
from tgw.broker.state.pool import WorkerHandle, WorkerState
from tgw.broker.state.stats import Stats

from .phase import BrokerPhase, Phase

log = logging.getLogger("tgw.broker")
FACE_HOLD_S = 0.0005   # how long gRPC's burst is waited for (Serving.arrived)


class Serving:
    def __init__(self, *, clock: Callable[[], float], phase: BrokerPhase, roster: list[WorkerHandle],
                 registry: Registry, batcher: Batcher, costs: CostModel, admission: Admission,
                 placement: Placement, unserved: Unserved, handshake: Handshake, memory: MemoryWatch,
                 replay: ReplayRecorder, door: FrontDoor, back: WorkerLink, loop: asyncio.AbstractEventLoop,
                 max_inflight: int, streams: Streams, enrols: bool = False):
        """The sequence wing is admission's (`admission.sequences`): one binding table for both."""
        self.clock, self.phase, self.roster = clock, phase, roster
        self.registry, self.batcher, self.costs, self.admission = registry, batcher, costs, admission
        self.placement, self.unserved, self.handshake, self.memory = placement, unserved, handshake, memory
        self.replay, self.door, self.back = replay, door, back
        self.streams = streams   # generations from their dispatch to their end (the generate wing)
        self.sequences: Sequences = admission.sequences   # sequence models' bindings (the sequence wing)
        self.max_inflight = max_inflight   # server.max_inflight_batches_per_worker
        # the roster is the supervisor's list, which it alone changes; a core made without a
        # supervisor (the test rigs) enrols workers itself, in add_worker
        self._enrols = enrols
        self.routes: dict[bytes, WorkerHandle] = {}       # identity -> worker whose process lives
        self.alarm = Alarm(loop, self.schedule)   # a held batch due, or the next request to expire
        self.loop = loop
        self.batch_seq = 0
        self._pump_handle: asyncio.Handle | None = None   # a pump is due (call_soon, or the end of a drain)
        self._hold_until = 0.0   # gRPC's burst is coming in (arrived): until then, full batches only

    # ---- control: called by the lifecycle -----------------------------------------------------

    def add_worker(self, w: WorkerHandle) -> None:
        """Route messages from (a new life of) this worker, and of its heartbeat thread, to it."""
        if self._enrols and w not in self.roster:
            self.roster.append(w)
        self.routes[w.identity] = self.routes[w.control_identity] = self.routes[w.loader_identity] = w

    def remove_worker(self, w: WorkerHandle) -> None:
        """The worker's process is gone: retry its in-flight requests once elsewhere, answer the rest."""
        for ident in (w.identity, w.control_identity, w.loader_identity):
            self.routes.pop(ident, None)
        self.memory.forget(w)
        self.sequences.lost(w)   # its sequences' state died with it
        for place in w.withdrawn_in_flight():   # nobody waits for these: not retried, counted where they died
            self.door.abandon.withdrawn(place.request.model, "computing")
        retry = self.phase.now is not Phase.STOPPING
        resumed = self.streams.lost(w, retry)   # its running generations, to continue elsewhere
        again, gone = self.handshake.lost(w, retry=retry)
        # a generation whose outputs overtook its admission batch's Done is in both: resumed once
        taken = {id(p) for p in resumed}
        again, gone = [p for p in again if id(p) not in taken], [p for p in gone if id(p) not in taken]
        for p in [p for p in again if p.sequence is not None]:   # never run elsewhere: no state there
            again.remove(p)
            gone.append(p)
        for p in reversed(again + resumed):
            self.batcher.push(p, front=True)
        for p in gone:
            self.door.fail(p, death_error(w, p) if p.sequence is None else self.sequences.death_error(w, p))
        self.schedule()

    def tick(self, now: float) -> None:
        """Periodic work: answer what expired or cannot run (unserved.py), breakers, snapshots."""
        self.unserved.sweep(now, self.phase.now is Phase.STOPPING)
        self.admission.breakers.check(now)
        self.streams.sweep(now)
        self.sequences.sweep(now)
        self.sequences.held(self._holds)
        if self.sequences.orphans:
            self.schedule()
        self.memory.snapshots.tick(now)
        self.door.tick()

    def _holds(self, ident: bytes, key: str) -> bool:
        """Whether the worker life `ident` still holds version `key` (the sequence wing's slots)."""
        w = self.routes.get(ident)
        return w is not None and key in w.models

    def abandon(self, message: str) -> None:
        self.unserved.everything(message)

    def snapshot(self, msg, answer: Callable) -> None:
        """A client's memory snapshot request (front door): of the workers it names."""
        self.memory.request(self.roster, msg, self.clock(), answer)

    def admit_copy(self, p) -> bool:
        """A shadow copy (canary/shadow.py) into the queues; the pump is due for each one queued."""
        queued = self.admission.copies.admit(p)
        if queued:
            self.schedule()
        return queued

    def withdraw(self, wanted) -> list:
        """The requests on workers that `wanted(p)` picks, taken out of their batches (nobody waits
        for them); each worker told at once, for batches it may not have launched (front/abandon.py)."""
        taken = []
        for w in self.roster:
            if w.inflight:
                hits, asks = w.withdraw(wanted)
                for ask in asks:
                    self.back.send(w.identity, ask)
                taken += hits
        return taken

    def busy(self) -> bool:
        return self.batcher.queued() > 0 or any(w.inflight or w.sequences for w in self.roster)

    def close(self) -> None:
        self.alarm.cancel()
        self.door.close()
        self.back.close()

    def stop_worker(self, w: WorkerHandle) -> None:
        if w.state in (WorkerState.STARTING, WorkerState.READY):
            w.told_to_stop()
            self.back.send(w.identity, Stop())

    # ---- scheduling --------------------------------------------------------------------------

    def schedule(self) -> None:
        if self._pump_handle is None:
            self._pump_handle = self.loop.call_soon(self.pump)

    def arrived(self, model: str) -> None:
        """A request for `model` from a caller whose requests trickle in (gRPC's: FrontDoor.infer)
        is queued. One that finds other requests admitted and unanswered opens a short window
        (FACE_HOLD_S) in which the pump sends only full batches: grpc.aio hands the loop one call
        at a time, so sent at once each would go alone to an idle worker and pay a whole batch's
        cost (docs/ARCHITECTURE.md#scheduling). A lone request (c=1) never waits. While the
        window is open the alarm pumps at its end; only a full batch needs a pump sooner."""
        if self._hold_until:
            if self.batcher.full(model):
                self.schedule()
            return
        if len(self.door.abandon.inflight) > 1:
            now = self.clock()
            self._hold_until = now + FACE_HOLD_S
            self.alarm.at(self._hold_until, now)
            if not self.batcher.full(model):
                return
        self.schedule()

    def flush(self) -> None:
        """At the end of a drain pass: form the batches now rather than on the next loop turn."""
        if self._pump_handle is not None:
            self.pump()

    def pump(self) -> None:
        """Hand batches to workers with room, round-robin over models, until nothing moves."""
        if self._pump_handle is not None:
            self._pump_handle.cancel()
            self._pump_handle = None
        full: set[int] = set()
        moved = True
        now = self.clock()
        settling = self._hold_until > now   # gRPC's burst still coming in: full batches only
        if settling:
            self.alarm.at(self._hold_until, now)
        else:
            self._hold_until = 0.0
        for p in self.batcher.expired_heads(now):
            self.door.fail(p, self.unserved.expired(p))
        if self.sequences.orphans:   # queued for a sequence that ended: answered, never run
            self.sequences.orphans = False
            for p in self.batcher.take_where(self.sequences.orphaned):
                self.door.fail(p, self.sequences.orphan_error(p))
        while moved:
            moved = False
            for model in self.batcher.models_with_work():
                if settling and not self.batcher.full(model):
                    continue
                head = self.batcher.head(model, now)
                key = model_key(model, head.version)
                # a sequence model's head may wait for its worker or a slot: the other workers may
                # still run the sequences behind it, so each is tried in turn
                tried = full if head.sequence is None else set(full)
                worker = self._pick(key, tried, head)
                if worker is None and head.record is not None and head.record.on_demand:
                    self.placement.demand(head.record, float("inf"))   # evicted while it waited: load again
                while worker is not None:
                    hold = self.batcher.hold_until(model, worker.worker_id, now)
                    if worker.inflight:  # stage the next batch just in time, not behind the one computing
                        hold = max(hold or 0.0, worker.free_at - self.costs.stage_ahead(model))
                    if hold is not None and hold > now:  # worth waiting: come back then
                        self.alarm.at(hold, now)
                        sent = None
                    else:
                        sent = self._dispatch(model, worker, now)
                    if sent:
                        moved = True
                        break
                    if sent is False:
                        full.add(worker.worker_id)
                    if tried is full:
                        break
                    tried.add(worker.worker_id)
                    worker = self._pick(key, tried, head)
        due = self.batcher.next_due()
        if due is not None:  # answer the next request to expire when it does, not at the next sweep
            self.alarm.at(due, now)
        for w in self.roster:
            # releases ride on the next batch; a busy worker with none coming may need the space
            if w.releases and w.inflight:
                self.back.send(w.identity, Release(blocks=w.take_releases()))

    def _pick(self, key: str, full: set[int], head) -> WorkerHandle | None:
        best, best_rank = None, None
        gen, seq = head.generate is not None, head.sequence is not None
        for w in self.roster:
            if w.worker_id not in full and w.can_take(key, self.max_inflight, head.alone, head) and \
                    (not gen or self.streams.room(w, key, head.model) > 0):
                # a sequence model's head goes first to a worker that may run it (its own, or one with a free slot)
                rank = (seq and not self.sequences.can_run(head, w, key), len(w.inflight))
                if best is None or rank < best_rank:
                    best, best_rank = w, rank
        return best

    def _dispatch(self, model: str, worker: WorkerHandle, now: float) -> bool | None:
        """Stage and send the next batch of `model` to `worker`: True when requests left the queue,
        False when the input arena is full, None when none may run there (a sequence model's)."""
        entry = self.registry.models[model]
        room = fits = None
        if entry.is_generator:   # no more sequences than the worker has free slots
            room = self.streams.room(worker, model_key(model, self.batcher.head(model, now).version), model)
        elif entry.decl.sequence_batching is not None:   # one step a sequence, on its worker, starts in free slots
            fits = self.sequences.chooser(worker, model_key(model, self.batcher.head(model, now).version))
        batch = self.batcher.next_batch(model, worker.input_bytes, worker.output_bytes, now, room, fits)
        if not batch:
            return None
        # compute is wasted on a request its batch cannot answer before its deadline; a staged
        # batch starts when the one computing is predicted to end
        start = max(now, worker.free_at) if worker.inflight else now
        done_by = start + self.costs.predict(model, sum(p.rows for p in batch), worker.worker_id)
        live = []
        for p in batch:
            if p.deadline <= done_by:
                self.door.fail(p, fail(Code.DEADLINE_EXCEEDED, "deadline passed while queued" if p.deadline <= now
                                       else "its batch is predicted to finish after its deadline",
                                       predicted_ms=round((done_by - now) * 1000, 3)))
            else:
                p.dispatch(now)
                live.append(p)
        if not live:
            return True
        self.batch_seq += 1
        msg = worker.stage(self.batch_seq, live, entry.inputs)
        if msg is None:  # input arena full until a completion frees a block
            for p in reversed(live):
                self.batcher.push(p, front=True)
            return False
        if msg.sequences:   # a generator's: its sequences hold slots on the worker from now on
            self.streams.dispatched(worker, msg.batch_id, model_key(model, msg.version), live)
        elif fits is not None:   # a sequence model's: its sequences bound, each request's slot
            msg.steps = self.sequences.dispatched(worker, model_key(model, msg.version), live)
        else:   # a generator's prompts are no warm-up batch (its loop warms itself)
            self.replay.record(entry, live)
        self.back.send(worker.identity, msg)
        worker.batch_sent(msg.batch_id, done_by, now)   # its version's last use: least recently used goes first
        return True


class WorkerMessages:
    def __init__(self, core: Serving, faults: CudaFaults, stats: Stats, progress: ProgressLines | None = None):
        """`progress`: where loads are printed as they move (by default the broker's stderr, when a terminal)."""
        self.core, self.stats = core, stats
        self.progress = progress if progress is not None else ProgressLines.for_stderr()
        self.handlers = {Done: self._complete, Heartbeat: self._on_beat, WorkerHello: self._on_hello,
                         WorkerReady: self._on_ready, WorkerFailed: self._on_failed,
                         WorkerSnapshot: self._on_snapshot, WorkerFault: faults.on_fault,
                         **{t: self._on_loader for t in core.placement.messages},
                         LoadPhase: self._on_phase, ModelLoaded: self._on_loaded, Steps: self._on_steps}

    def on_message(self, frames: list) -> None:
        ident = frames[0].bytes
        try:
            msg = from_worker_decoder.decode(frames[1].buffer)
        except (DecodeError, IndexError) as exc:
            log.error("undecodable message from worker %r: %s", ident, exc)
            return
        worker = self.core.routes.get(ident)
        if worker is None:
            log.warning("message from unknown or replaced worker %r ignored", ident)
            return
        handler = self.handlers.get(type(msg))
        if handler is None:
            log.warning("message %s from %s has no handler: ignored", type(msg).__name__, worker.name)
            return
        handler(worker, msg)

    def _on_beat(self, worker: WorkerHandle, msg: Heartbeat) -> None:
        worker.beat_came(msg, self.core.clock())
        self.core.memory.on_beat(worker, msg, worker.beat_at)
        self.core.admission.breakers.on_beat(worker, msg, worker.beat_at)

    def _on_snapshot(self, worker: WorkerHandle, msg: WorkerSnapshot) -> None:
        self.core.memory.on_snapshot(worker, msg, self.core.clock())

    def _on_hello(self, worker: WorkerHandle, msg: WorkerHello) -> None:
        self.core.back.send(worker.identity, self.core.handshake.hello(worker, msg, self.core.clock()))

    def _on_ready(self, worker: WorkerHandle, msg: WorkerReady) -> None:
        if self.core.handshake.ready(worker, msg, self.core.clock()):
            self.core.placement.reconcile()
            self.core.schedule()

    def _on_phase(self, worker: WorkerHandle, msg: LoadPhase) -> None:
        worker.load_moved(msg.key, msg.phase, msg.seconds, self.core.clock())
        self.progress.moved(worker.name, msg.key, msg.phase, msg.seconds)

    def _on_loaded(self, worker: WorkerHandle, msg: ModelLoaded) -> None:
        """A load ended: printed if its phases were told (a repeated load's answer tells none);
        a start-up model serves from now on, a run-time load goes to placement."""
        if not self.core.sequences.loaded(worker, msg):   # a sequence model's slots ...
            self.core.streams.loaded(worker, msg)          # ... or a generator's
        under_way = worker.under_way.get(msg.key)
        if under_way is not None and msg.error is None:
            self.progress.ready(worker.name, msg.key, (msg.load_ms - msg.warm_ms) / 1000, msg.warm_ms / 1000)
        elif under_way is not None:
            self.progress.failed(worker.name, msg.key, self.core.clock() - under_way.since, msg.error)
        if not msg.startup:
            self._on_loader(worker, msg)
        elif self.core.handshake.model_loaded(worker, msg):
            self.core.schedule()   # requests for it may be queued already

    def _on_steps(self, worker: WorkerHandle, msg: Steps) -> None:
        """A step of a generator's loop (the generate wing's); a freed slot may take a queued one."""
        if self.core.streams.on_steps(worker, msg):
            self.core.schedule()

    def _on_failed(self, worker: WorkerHandle, msg: WorkerFailed) -> None:
        """A start-up model (or a preload) failed: the worker serves no more, it is stopped."""
        under_way = worker.under_way.get(msg.model)
        self.progress.failed(worker.name, msg.model,
                             self.core.clock() - under_way.since if under_way is not None else None, msg.error)
        self.core.handshake.failed(worker, msg)
        self.core.stop_worker(worker)

    def _on_loader(self, worker: WorkerHandle, msg) -> None:
        """Its loader thread: runtime loads and unloads."""
        self.core.placement.messages[type(msg)](worker, msg)
        self.core.schedule()

    def _complete(self, worker: WorkerHandle, done: Done) -> None:
        batch, part, left_out = worker.take_part(done)  # all of a batch, or a part of one too large for the output arena
        if batch is None:
            log.warning("completion for unknown batch %d from %s", done.batch_id, worker.name)
            return
        abandon = self.core.door.abandon
        if left_out:   # taken out before launch: never computed
            abandon.withdrawn(batch.model, "staged", sum(type(e) is Gone for e in left_out))
            for p in (e for e in left_out if type(e) is not Gone):   # a worker bug: nobody asked
                self.core.door.fail(p, fail(Code.INTERNAL, "the worker left this request out of its batch"))
        now = self.core.clock()
        if done.error is not None:
            for p in part:  # each its own exception: details are filled in per request
                if type(p) is not Gone:
                    self.core.door.fail(p, error_from_body(done.error))
        else:
            answered = []
            for k, (p, views) in enumerate(worker.output_rows(done, batch, part), done.first):
                if type(p) is Gone:   # computed, nobody waits: dropped
                    continue
                if k in done.failed:   # a stage failed this request's rows: its error, not its rows
                    self.core.door.fail(p, error_from_body(done.failed[k]))
                    continue
                answered.append((p, views))
            if answered and batch.batch_id in self.core.streams.by_batch:
                self.core.streams.admitted([p for p, _ in answered], now)   # in its loop: the wing answers them
            elif answered:
                self.core.door.answer(answered, now)
                self.stats.models[batch.model].replies += len(answered)
            # safe right after the replies: each send copied its frames out of the ring
            if done.block is not None:
                worker.release_later(done.block)
        computed = sum(type(p) is Gone for p in part)
        if computed:
            abandon.withdrawn(batch.model, "computing", computed)
        if done.final and batch.rows and (done.error is None or done.first):  # counted unless one error failed it whole
            self.stats.batch(batch.model, batch.rows, done.compute_us, batch.key[len(batch.model) + 1:])
            self.core.costs.observe(batch.model, worker.worker_id, batch.rows, done.compute_us)
        if done.final:  # what the worker holds now starts computing now
            worker.busy_until(now + sum(self.core.costs.predict(staged.model, staged.rows, worker.worker_id)
                                        for staged in worker.inflight.values()))
        for p in batch.requests if done.final else ():  # a final part that left some out: a worker bug
            self.core.door.fail(p, fail(Code.INTERNAL, "the worker's completions left this request unanswered"))
        if done.final and batch.batch_id in self.core.streams.by_batch:   # a generator's admission batch
            self.core.streams.batch_done(batch.batch_id, [e.request for e in part if type(e) is Gone])
        if worker.holding.evicting:  # a version it no longer holds may have finished its last batch
            self.core.placement.reconcile()
        self.core.schedule()
