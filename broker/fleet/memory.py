"""Watching workers' memory: heartbeats feed the leak judge and, after unloads, the fragmentation
judge; a leak gets a traced snapshot and then a graceful recycle, fragmentation the recycle at
once (carried out by the lifecycle); operators ask for snapshots with `tgw-broker snapshot` or
SIGUSR1.
"""
from __future__ import annotations

import logging
from typing import Callable

from tgw.shm.errors import Code, fail
from tgw.shm.wire import PROTOCOL_VERSION, Footprint, Heartbeat, Snapshot, SnapshotReply, WorkerSnapshot

from tgw.broker.config.load import SupervisorDecl
from .fragmentation import FragmentationJudge, cuda_waste, need
from .leaks import LeakJudge
from tgw.broker.state.pool import WorkerHandle, WorkerState
from .snapshots import Snapshots

log = logging.getLogger("tgw.broker")


class MemoryWatch:
    def __init__(self, decl: SupervisorDecl, send: Callable[[bytes, object], None]):
        self.decl = decl
        self.leaks = LeakJudge(decl.leak)
        self.fragments = FragmentationJudge(decl.fragmentation)
        self.fragmented = 0                       # workers found fragmented (status, tests)
        self.snapshots = Snapshots(decl, self.leaks, send)
        self.to_recycle: list[WorkerHandle] = []   # leaking workers the lifecycle should replace
        self._flagged: set[bytes] = set()         # lives already found leaking: one snapshot each

    def on_beat(self, w: WorkerHandle, beat: Heartbeat, now: float) -> None:
        if w.state is not WorkerState.READY:  # loading and warming up grow memory by design
            return
        self._judge_fragments(w, beat)
        why = self.leaks.record(w.identity, beat, now)
        if not why or w.identity in self._flagged or w.retiring:
            return
        self._flagged.add(w.identity)
        self.snapshots.take(w, f"leak: {why}", now, traced=True, on_done=lambda path: self._leaked(w))

    def _judge_fragments(self, w: WorkerHandle, beat: Heartbeat) -> None:
        h = w.holding
        if not h.unloads or h.loading or h.unloading or w.retiring or w.identity in self._flagged:
            self.fragments.quiet(w.identity)   # nothing freed yet, or memory moving on purpose
            return
        weights, activation = need(held_footprints(w))
        if w.device.startswith("cuda"):
            waste, total = cuda_waste(beat.cuda_reserved, beat.cuda_allocated, activation)
        else:
            waste, total = self.fragments.cpu_waste(w.identity, beat.rss_anon, weights, activation)
        why = self.fragments.record(w.identity, waste, total)
        if not why:
            return
        self._flagged.add(w.identity)
        self.fragmented += 1
        log.warning("%s fragmented: %s%s", w.name, why, ": recycling it" if self.decl.fragmentation.recycle else "",
                    extra={"event": "fragmentation", "worker": w.name, "waste": waste, "total": total})
        if self.decl.fragmentation.recycle:
            self.to_recycle.append(w)

    def _leaked(self, w: WorkerHandle) -> None:
        if self.decl.leak.recycle and w.state is WorkerState.READY and not w.retiring:
            self.to_recycle.append(w)

    def on_snapshot(self, w: WorkerHandle, msg: WorkerSnapshot, now: float) -> None:
        self.snapshots.on_reply(w, msg, now)

    def forget(self, w: WorkerHandle) -> None:
        """A life ended: its history goes (a new life is judged afresh)."""
        self.leaks.forget(w.identity)
        if w.state is WorkerState.READY:   # a load or unload (placement's on_resize): the same life
            self.fragments.quiet(w.identity)
        else:
            self.fragments.forget(w.identity)
        self._flagged.discard(w.identity)

    def request(self, workers: list[WorkerHandle], msg: Snapshot, now: float,
                answer: Callable[[object], None]) -> None:
        """A client's snapshot op: one file per live worker (or the one asked for), then one reply."""
        live = [w for w in workers if w.state is WorkerState.READY]
        if msg.worker is not None:
            live = [w for w in live if w.worker_id == msg.worker]
            if not live:
                raise fail(Code.INVALID_ARGUMENT, f"no live worker {msg.worker}",
                           workers=sorted(w.worker_id for w in workers if w.state is WorkerState.READY))
        if not live:
            raise fail(Code.MODEL_NOT_READY, "no live worker to snapshot")
        files, missing, left = [], [], [len(live)]

        def done(w: WorkerHandle, path: str | None) -> None:
            if path:
                files.append(path)
            else:
                missing.append(w.name)
            left[0] -= 1
            if not left[0]:
                answer(SnapshotReply(v=PROTOCOL_VERSION, id=msg.id, files=files, missing=missing))

        for w in live:
            self.snapshots.take(w, "requested", now, on_done=lambda path, w=w: done(w, path))

    def snapshot_all(self, workers: list[WorkerHandle], reason: str, now: float) -> None:
        for w in workers:
            if w.state is WorkerState.READY:
                self.snapshots.take(w, reason, now)


def held_footprints(w: WorkerHandle) -> list[Footprint]:
    """What the versions it holds need: measured footprints, parameter bytes where unmeasured."""
    return [fp if (fp := w.footprints.get(k)) is not None and fp.measured_on else Footprint(weights=w.sizes.get(k, 0))
            for k in w.models]
