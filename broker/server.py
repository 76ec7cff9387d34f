"""The broker's serving core: client requests in, batches to workers, replies out.

Everything here runs as plain callbacks on one uvloop loop: decode once, admit, queue, and
let one pump per loop turn form batches for workers with room (so a burst drained from the
socket becomes one batch, not many). It owns routing to workers (the roster it reads is the
supervisor's), the phase and the batch sequence; queues live in batcher, checks in admission,
the clients' side in frontdoor, what workers send in worker_messages, the worker handshake in
handshake, versions on workers in placement, the answers no worker gives in unserved,
read-only answers in status.
"""
from __future__ import annotations

import asyncio
import logging
import time
from enum import Enum
from typing import Callable

import zmq

from tgw.shm.errors import Code, fail
from tgw.shm.wire import Release, Stop, encode, model_key

from tgw.broker.canary.guards import Guards
from tgw.broker.canary.shadow import Shadows
from tgw.broker.config.load import Config
from tgw.broker.fleet.handshake import Handshake, death_error
from tgw.broker.fleet.faults import CudaFaults
from tgw.broker.fleet.memory import MemoryWatch
from tgw.broker.front.callers import Callers
from tgw.broker.front.frontdoor import FrontDoor
from tgw.broker.front.sockets import Pump
from tgw.broker.models.placement import Placement
from tgw.broker.models.registry import Registry
from tgw.broker.models.replay import ReplayRecorder
from tgw.broker.observe.metrics import Metrics
from tgw.broker.pipeline.executor import Pipelines
from tgw.broker.sched.admission import Admission
from tgw.broker.sched.alarm import Alarm
from tgw.broker.sched.batcher import Batcher
from tgw.broker.sched.costmodel import CostModel
from tgw.broker.sched.unserved import Unserved
from tgw.broker.state.complaints import Complaints
from tgw.broker.state.pool import WorkerHandle, WorkerState
from tgw.broker.state.stats import Stats as Counters

from . import wiring
from .worker_messages import WorkerMessages

log = logging.getLogger("tgw.broker")


class Phase(Enum):
    STARTING = "starting"    # workers loading; requests for versions not yet ready are refused
    SERVING = "serving"
    DRAINING = "draining"    # the drain notice (server.drain_notice_s): not ready, still serving everything
    STOPPING = "stopping"    # new requests refused; queued and in-flight ones finish


class Broker:
    operator = None   # operator.Operator: control ops and SIGHUP (main.py attaches it)
    http = None       # http_face.HttpFace when configured (main.py attaches it)

    def __init__(self, cfg: Config, clock: Callable[[], float] = time.monotonic, max_clients: int | None = None,
                 token: str | None = None, workers: int = 1, roster: list[WorkerHandle] | None = None):
        self.clock, self.server, self.token = clock, cfg.server, token
        self.complaints = Complaints(clock)
        self.callers = Callers(cfg.server, max_clients or cfg.server.max_clients, clock)
        self.registry = Registry(cfg)
        self.costs = CostModel()
        self.batcher = Batcher(clock, self.costs)
        self.stats = Counters()
        for m in cfg.models:
            self.batcher.declare(m)
            self.stats.model(m.name)
        # every worker, in any state: the supervisor's list, which it alone changes (main.py);
        # a broker made without one (the test rigs) enrols workers itself, in add_worker
        self.roster: list[WorkerHandle] = [] if roster is None else roster
        self._enrols = roster is None
        self.replay = ReplayRecorder(cfg.warmup)   # each model's recent batches, for versions loaded later
        self.placement = Placement(self.registry, self.roster, self.send, clock,  # which worker holds which version
                                   cfg.workers.max_model_memory, cfg.workers.placement, self.replay)
        answer_error = lambda p, err: self.door.fail(p, err)   # noqa: E731 - the door is made in attach
        self.unserved = Unserved(self.batcher, self.roster, answer_error,
                                 self.placement.resident)   # answers for requests no worker will run
        self.placement.on_failed = self.unserved.load_failed
        self.admission = Admission(cfg, self.registry, self.batcher, self.stats, self.callers.owed, clock,
                                   self.unserved.unavailable, shed=answer_error, workers=workers,
                                   demand=self.placement.demand, drained=lambda rec: self.placement.wake())
        self.handshake = Handshake(self.registry, self.is_serving, self.placement.forget_failed,
                                   self.placement.budget)
        self.memory = MemoryWatch(cfg.supervisor, self.send)
        self.faults = CudaFaults(cfg.supervisor.cuda_faults, clock,   # sticky CUDA errors (worker_messages)
                                 self.memory.snapshots.write_fault)
        self.placement.on_resize = lambda w: self.memory.forget(w)  # a load is no leak: judge afresh
        self.max_inflight = cfg.server.max_inflight_batches_per_worker
        self.routes: dict[bytes, WorkerHandle] = {}       # identity -> worker whose process lives
        self.pipelines = Pipelines(wiring.pipeline_deps(self), cfg.pipelines)   # names served as DAGs of steps
        self.shadows = Shadows(self.registry.models, wiring.admit_copy(self), self.admission.copies.withdraw, clock)
        self.guards = Guards(self.shadows, clock, wiring.decide(self))   # guarded canaries and shadows
        self.admission.on_finished.append(self.guards.exits)
        self.phase = Phase.STARTING
        self.started_at = clock()
        self.view = wiring.observe_view(self)   # what status, /metrics and the HTTP face read
        self.metrics = Metrics(self.view)
        self.admission.on_finished.append(self.metrics.finished)
        self.batch_seq = 0
        self._pump_handle: asyncio.Handle | None = None   # a pump is due (call_soon, or the end of a drain)
        self.workers_side = WorkerMessages(self)   # what workers send, by one table

    def attach(self, loop: asyncio.AbstractEventLoop, front: zmq.Socket, back: zmq.Socket,
               zap: zmq.Socket | None = None) -> None:
        self.loop = loop
        self.alarm = Alarm(loop, self.schedule)   # a held batch due, or the next request to expire
        self.door = FrontDoor(wiring.door_deps(self), loop, front, zap)
        self.admission.on_finished.append(self.door.abandon.finished)
        self.back = Pump(loop, back, self.workers_side.on_message, after=self.flush)

    def operate(self, ident, msg) -> None:
        if self.operator is None:
            return self.door.error(ident, msg.id, fail(Code.INTERNAL, "this broker has no operator controls"))
        self.operator.handle(ident, msg)

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
        for place in w.withdrawn_in_flight():   # nobody waits for these: not retried, counted where they died
            self.door.abandon.withdrawn(place.request.model, "computing")
        again, gone = self.handshake.lost(w, retry=self.phase is not Phase.STOPPING)
        for p in reversed(again):
            self.batcher.push(p, front=True)
        for p in gone:
            self.door.fail(p, death_error(w, p))
        self.schedule()

    def tick(self, now: float) -> None:
        """Periodic work: answer what expired or cannot run (unserved.py), breakers, snapshots."""
        self.unserved.sweep(now, self.phase is Phase.STOPPING)
        self.admission.breakers.check(now)
        self.memory.snapshots.tick(now)
        self.door.tick()
        self.guards.check(now)

    def abandon(self, message: str) -> None:
        self.unserved.everything(message)

    def send(self, ident: bytes, msg) -> None:
        self.back.send([ident, encode(msg)])

    def withdraw(self, wanted) -> list:
        """The requests on workers that `wanted(p)` picks, taken out of their batches (nobody waits
        for them); each worker told at once, for batches it may not have launched (front/abandon.py)."""
        taken = []
        for w in self.roster:
            if w.inflight:
                hits, asks = w.withdraw(wanted)
                for ask in asks:
                    self.back.send([w.identity, encode(ask)])
                taken += hits
        return taken

    def is_serving(self) -> bool:
        """Taking and serving requests: also during the drain notice, which only health hides."""
        return self.phase is Phase.SERVING or self.phase is Phase.DRAINING

    def start_serving(self) -> None:
        self.phase = Phase.SERVING

    def announce_stop(self) -> None:
        """The drain notice: health says not ready, everything else goes on serving."""
        self.phase = Phase.DRAINING

    def begin_stop(self) -> None:
        self.phase = Phase.STOPPING
        self.admission.open = False

    def busy(self) -> bool:
        return self.batcher.queued() > 0 or any(w.inflight for w in self.roster)

    def close(self) -> None:
        self.alarm.cancel()
        self.door.close()
        self.back.close()

    def stop_worker(self, w: WorkerHandle) -> None:
        if w.state in (WorkerState.STARTING, WorkerState.READY):
            w.told_to_stop()
            self.back.send([w.identity, encode(Stop())])

    # ---- scheduling --------------------------------------------------------------------------

    def schedule(self) -> None:
        if self._pump_handle is None:
            self._pump_handle = self.loop.call_soon(self.pump)

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
        for p in self.batcher.expired_heads(now):
            self.door.fail(p, self.unserved.expired(p))
        while moved:
            moved = False
            for model in self.batcher.models_with_work():
                head = self.batcher.head(model, now)
                worker = self._pick(model_key(model, head.version), full, head)
                if worker is None:
                    if head.record is not None and head.record.on_demand:  # evicted while it waited: load again
                        self.placement.demand(head.record, float("inf"))
                    continue
                hold = self.batcher.hold_until(model, worker.worker_id, now)
                if worker.inflight:  # stage the next batch just in time, not behind the one computing
                    hold = max(hold or 0.0, worker.free_at - self.costs.stage_ahead(model))
                if hold is not None and hold > now:  # worth waiting: come back then
                    self.alarm.at(hold, now)
                    continue
                if self._dispatch(model, worker, now):
                    moved = True
                else:
                    full.add(worker.worker_id)
        due = self.batcher.next_due()
        if due is not None:  # answer the next request to expire when it does, not at the next sweep
            self.alarm.at(due, now)
        for w in self.roster:
            # releases ride on the next batch; a busy worker with none coming may need the space
            if w.releases and w.inflight:
                self.back.send([w.identity, encode(Release(blocks=w.take_releases()))])

    def _pick(self, key: str, full: set[int], head) -> WorkerHandle | None:
        best = None
        for w in self.roster:
            if w.worker_id not in full and w.can_take(key, self.max_inflight, head.alone, head):
                if best is None or len(w.inflight) < len(best.inflight):
                    best = w
        return best

    def _dispatch(self, model: str, worker: WorkerHandle, now: float) -> bool:
        batch = self.batcher.next_batch(model, worker.input_bytes, worker.output_bytes, now)
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
        entry = self.registry.models[model]
        msg = worker.stage(self.batch_seq, live, entry.inputs)
        if msg is None:  # input arena full until a completion frees a block
            for p in reversed(live):
                self.batcher.push(p, front=True)
            return False
        self.replay.record(entry, live)
        self.back.send([worker.identity, encode(msg)])
        worker.batch_sent(msg.batch_id, done_by, now)   # its version's last use: least recently used goes first
        return True

    # ---- worker side -------------------------------------------------------------------------
