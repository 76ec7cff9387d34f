"""What workers send the broker, on the back socket: one handler per message type.

Completions answer their requests (those a stage failed, Done.failed, with their errors) and
feed the stats and the cost model; a withdrawn request (state/inflight.py) is never answered,
and counted by where it was: "staged" when the worker took it out before launch, "computing"
when its batch had launched (its rows dropped); heartbeats feed the memory watch and the breakers; the
handshake's messages go to fleet/handshake.py, a sticky CUDA error's to fleet/faults.py, the
loader thread's to models/placement.py. Part of the core: it works on the serving core itself.
"""
from __future__ import annotations

import logging

from tgw.shm.errors import Code, error_from_body, fail
from tgw.shm.wire import DecodeError, Done, Heartbeat, WorkerFailed, WorkerFault, WorkerHello, WorkerReady, \
    WorkerSnapshot, from_worker_decoder

from tgw.broker.fleet.faults import CudaFaults
from tgw.broker.state.inflight import Gone
from tgw.broker.state.pool import WorkerHandle
from tgw.broker.state.stats import Stats

from .serving import Serving

log = logging.getLogger("tgw.broker")


class WorkerMessages:
    def __init__(self, core: Serving, faults: CudaFaults, stats: Stats):
        self.core, self.stats = core, stats
        self.handlers = {Done: self._complete, Heartbeat: self._on_beat, WorkerHello: self._on_hello,
                         WorkerReady: self._on_ready, WorkerFailed: core.handshake.failed,
                         WorkerSnapshot: self._on_snapshot, WorkerFault: faults.on_fault,
                         **{t: self._on_loader for t in core.placement.messages}}

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
        self.core.back.send(worker.identity, self.core.handshake.hello(worker, msg))

    def _on_ready(self, worker: WorkerHandle, msg: WorkerReady) -> None:
        if self.core.handshake.ready(worker, msg, self.core.clock()):
            self.core.placement.reconcile()
            self.core.schedule()

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
            if answered:
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
        if worker.holding.evicting:  # a version it no longer holds may have finished its last batch
            self.core.placement.reconcile()
        self.core.schedule()
