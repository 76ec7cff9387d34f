"""Memory snapshots of workers, written as JSON files in the snapshot directory.

A snapshot asks the worker's heartbeat thread (so it is answered even mid-batch) for its
tracemalloc figures; the first request to a worker starts tracemalloc, so growth by line is
reported from then on. A leak snapshot therefore asks twice, `leak.trace_s` apart, and the
file holds the growth in between. Each file also holds the worker's RSS history over the leak
window, its last heartbeat, its ring and the /dev/shm listing.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import msgspec

from tgw.shm import segment as shm_segment
from tgw.shm.paths import runtime_dir
from tgw.shm.wire import SnapshotRequest, WorkerSnapshot

from tgw.broker.config.load import SupervisorDecl
from .leaks import LeakJudge
from tgw.broker.state.pool import WorkerHandle

log = logging.getLogger("tgw.supervisor")
ANSWER_S = 10.0  # a worker that does not answer a snapshot request within this is left out


def snapshot_dir(decl: SupervisorDecl) -> str:
    if decl.snapshot_dir:
        return decl.snapshot_dir
    state = os.environ.get("STATE_DIRECTORY")  # systemd's StateDirectory=
    return os.path.join(state.split(":")[0] if state else runtime_dir(), "snapshots")


@dataclass
class Taking:
    worker: WorkerHandle
    reason: str
    asks_left: int                # 2 for a leak (start tracing, then read growth), else 1
    ask_at: float                 # when to ask (again)
    asked_at: float | None = None   # when the worker was asked; None: not (yet, or again) asked
    snapshot_id: int = 0
    on_done: list[Callable[[str | None], None]] = field(default_factory=list)  # path, or None if lost


class Snapshots:
    def __init__(self, decl: SupervisorDecl, leaks: LeakJudge, send: Callable[[bytes, object], None]):
        self.decl, self.leaks, self.send = decl, leaks, send
        self.dir = snapshot_dir(decl)
        self.taking: dict[int, Taking] = {}      # by worker_id: one snapshot at a time per worker
        self.recent: list[str] = []              # files written, newest last
        self._ids = itertools.count(1)

    def latest(self) -> list[str]:
        """The snapshot files written lately, newest last (status)."""
        return self.recent

    def take(self, w: WorkerHandle, reason: str, now: float, traced: bool = False,
             on_done: Callable[[str | None], None] | None = None) -> None:
        """Start a snapshot of `w` (joining one under way); `traced`: wait trace_s for growth."""
        t = self.taking.get(w.worker_id)
        if t is None:
            t = self.taking[w.worker_id] = Taking(w, reason, 2 if traced else 1, now)
        if on_done is not None:
            t.on_done.append(on_done)

    def tick(self, now: float) -> None:
        for wid, t in list(self.taking.items()):
            if t.asked_at is not None and now - t.asked_at > ANSWER_S:
                log.warning("%s did not answer its snapshot request", t.worker.name)
                self._finish(wid, None)
            elif t.asked_at is None and now >= t.ask_at and t.worker.beat is not None:
                # after a beat: the broker's socket knows the worker's control peer by then
                t.snapshot_id, t.asked_at = next(self._ids), now
                self.send(t.worker.control_identity, SnapshotRequest(snapshot_id=t.snapshot_id))

    def on_reply(self, w: WorkerHandle, msg: WorkerSnapshot, now: float) -> None:
        t = self.taking.get(w.worker_id)
        if t is None or t.snapshot_id != msg.snapshot_id:
            return
        t.asks_left -= 1
        if t.asks_left:                   # tracing runs now; ask again for the growth since
            t.asked_at, t.ask_at = None, now + self.decl.leak.trace_s
            return
        self._finish(w.worker_id, self._write(t, msg))

    def _finish(self, worker_id: int, path: str | None) -> None:
        for done in self.taking.pop(worker_id).on_done:
            done(path)

    def _write(self, t: Taking, msg: WorkerSnapshot) -> str:
        return self._file(t.worker, t.reason, str(msg.snapshot_id), {
            "tracemalloc": {"traced_bytes": msg.traced_bytes, "tracing_for_s": round(time.monotonic() - msg.tracing_since, 3),
                            "growth": msgspec.to_builtins(msg.growth)},
            "cuda": msg.cuda})

    def write_fault(self, w: WorkerHandle, record: dict) -> str | None:
        """A sticky CUDA error's file, written by the broker alone: the worker's context is broken,
        so nothing is asked of it. None (logged) when the directory cannot be written."""
        try:
            return self._file(w, f"CUDA fault: {record['error']}", "fault", {"fault": record})
        except OSError as exc:
            log.error("cannot write the CUDA fault snapshot of %s: %s", w.name, exc)
            return None

    def _file(self, w: WorkerHandle, reason: str, tag: str, figures: dict) -> str:
        doc = {
            "worker": w.name, "pid": w.pid, "device": w.device, "reason": reason,
            "taken_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "heartbeat": msgspec.to_builtins(w.beat) if w.beat is not None else None,
            "rss_history": self.leaks.samples(w.identity), **figures,
            "ring": {"segment": w.segment.name, "input_capacity": w.input_bytes, "input_used": w.inputs.used_bytes,
                     "input_live_blocks": w.inputs.live_blocks, "output_capacity": w.output_bytes,
                     "inflight_batches": len(w.inflight), "output_releases_pending": len(w.releases)},
            "dev_shm": shm_listing(),
        }
        os.makedirs(self.dir, mode=0o750, exist_ok=True)
        path = os.path.join(self.dir, f"{time.strftime('%Y%m%d-%H%M%S')}-{w.name}.{w.generation}-{tag}.json")
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
        log.warning("snapshot of %s (%s) written to %s", w.name, reason[:200], path)
        self.recent = (self.recent + [path])[-20:]
        return path


def shm_listing() -> list[dict]:
    out = []
    for name in shm_segment.list_segments():
        try:
            out.append({"name": name, "bytes": os.stat(os.path.join(shm_segment.SHM_DIR, name)).st_size})
        except OSError:
            continue
    return out
