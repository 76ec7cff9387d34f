"""Which versions each live worker should hold, and the loads and unloads that make it so.

Desired state: every version record of an always-resident model (loading, ready or draining)
on every live worker whose role holds it (roles.py: models on model workers, stages where they
run), and the on-demand versions placed on it (residency.py). `reconcile`
compares that with what each worker holds and sends the difference to its loader thread: a
load for what is missing, and for what is no longer wanted first no new batches, then an
unload once none is in flight. Completions update the worker and wake whoever waits on a
condition (a rollout waiting for every worker to be warm, a drain, an unload). Reconciling
against the current roster, rather than remembering who was asked what, makes a worker that
dies or restarts mid-rollout harmless: its next life loads the current set at hello.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from typing import Callable

from tgw.shm.errors import Code, fail
from tgw.shm.wire import LoaderHello, LoadModel, ModelLoaded, ModelUnloaded, UnloadModel, as_builtins

from tgw.broker.state.pool import WorkerHandle, WorkerState
from tgw.broker.state.versions import VersionRecord
from .registry import Registry
from .replay import ReplayRecorder, summary
from .residency import Residency, budget_bytes
from .roles import serves

log = logging.getLogger("tgw.broker")
EVENTS_KEPT = 50
LOAD_RETRY_S = 10.0   # after an on-demand load failed, requests are refused this long instead of loading again


class Placement:
    def __init__(self, registry: Registry, roster: list[WorkerHandle], send: Callable[[bytes, object], None],
                 clock: Callable[[], float] = time.monotonic, model_memory: int | float | None = None,
                 policy: str = "spread", replay: ReplayRecorder | None = None,
                 on_failed: Callable[[str, str, str], None] = lambda key, reason, error: None,
                 on_resize: Callable[[WorkerHandle], None] = lambda w: None):
        self.registry, self.roster, self.send, self.clock = registry, roster, send, clock
        self.replay = replay   # recent batches per model: run-time loads warm up on them (replay.py)
        self.model_memory = model_memory  # workers.max_model_memory: each worker's budget (a reload may change it)
        self.residency = Residency(registry.record, self.note, policy)   # policy: workers.placement
        self.events: deque[dict] = deque(maxlen=EVENTS_KEPT)
        self.failures: dict[str, list[tuple[WorkerHandle, ModelLoaded]]] = {}  # key -> failed loads, for waiters
        self.watching: set[str] = set()   # keys a rollout waits on (their failures are kept for it)
        self.seq = 0                      # events noted so far
        self.on_failed = on_failed   # (key, reason, error): a version failed to load; what waits for it fails
        self.on_resize = on_resize   # a worker's memory changed on purpose (a load is no leak)
        self.started_at = clock()
        self._waiters: list[asyncio.Future] = []
        self.messages = {LoaderHello: self.on_loader_hello, ModelLoaded: self.on_loaded,
                         ModelUnloaded: self.on_unloaded}   # from workers' loader threads

    def note(self, event: str, key: str, w: WorkerHandle | None = None, **figures) -> None:
        name, _, version = key.partition(":")
        self.seq += 1
        self.events.append({"seq": self.seq, "at_s": round(self.clock() - self.started_at, 3), "event": event,
                            "model": name, "version": version, "worker": w.name if w is not None else "", **figures})

    # ---- desired vs held ---------------------------------------------------------------------

    def live(self, model: str | None = None) -> list[WorkerHandle]:
        """The workers serving now (of those whose role holds `model`, when given)."""
        return [w for w in self.roster if w.state is WorkerState.READY and not w.retiring and
                (model is None or self.holds(w, model))]

    def desired(self, w: WorkerHandle) -> set[str]:
        always = {r.key for m in self.registry.models.values() if not m.on_demand and self.holds(w, m.name)
                  for r in m.records.values()}
        return always | w.holding.wanted

    def holds(self, w: WorkerHandle, model: str) -> bool:
        """Whether `w`'s role holds versions of this model (or stage)."""
        m = self.registry.models.get(model)
        return m is not None and serves(w.role, w.device, m.decl.is_stage, m.decl.device)

    def reconcile(self) -> None:
        for w in self.live():
            h = w.holding
            if not h.loader_ready:
                continue
            want = self.desired(w)
            for key in want - w.models - h.loading.keys() - h.unloading:
                rec = self.registry.record(key)
                if key in self.failures:   # a rollout's failed load: not tried again, the rollout takes it out
                    continue
                if rec is not None and (not rec.on_demand or self.residency.room(w, key)):
                    w.load_sent(key, self.clock())
                    self.send(w.loader_identity, LoadModel(spec=self.spec(rec)))
            w.keep_only(want)
            for key in list(h.evicting):
                if not w.holds(key):
                    w.unload_sent(key)
                    self.send(w.loader_identity, UnloadModel(key=key))
        self.wake()

    def spec(self, rec: VersionRecord):
        """What a worker is asked to load at run time: the version, and the model's recent batches to
        warm up on when it has served some (start-up loads, in handshake.py, have none to replay)."""
        entry = self.registry.models[rec.model]
        spec = entry.spec(rec)
        if self.replay is not None:
            spec.replay = self.replay.replay(entry)
        return spec

    def place(self, rec: VersionRecord) -> WorkerHandle | None:
        """An on-demand version loading at run time: on the live worker with the most room."""
        return self.residency.place(rec, self._takers(rec))

    def _takers(self, rec: VersionRecord) -> list[WorkerHandle]:
        return [w for w in self.roster if self.holds(w, rec.model)]

    def unwant(self, keys: list[str]) -> None:
        """Versions forgotten: no worker is to load them on demand any more."""
        for w in self.roster:
            w.unwant(keys)

    def budget(self, w: WorkerHandle) -> int | None:
        """Bytes its models may take, once its hello told its device's memory."""
        return budget_bytes(self.model_memory, w.device, w.device_memory)

    def set_model_memory(self, model_memory: int | float | None) -> None:
        self.model_memory = model_memory
        for w in self.roster:
            w.budgeted(self.budget(w))

    def demand(self, rec: VersionRecord, wait_s: float) -> None:
        """An on-demand version was asked for: have it loaded if no live worker has it. Refuses
        (MODEL_NOT_READY, retryable) a request that its load is predicted to outlast."""
        w = self.residency.where(rec.key, self.roster)
        if w is None and rec.error and (wait := rec.failed_at + LOAD_RETRY_S - self.clock()) > 0:
            # a broken file fails every load alike: do not pay for one per request
            raise fail(Code.MODEL_NOT_READY, f"{rec.key} failed to load {LOAD_RETRY_S - wait:.1f} s ago ({rec.error}); "
                       f"the next load is tried in {wait:.1f} s", model=rec.model, version=rec.version,
                       reason="load_failed", retryable=False, retry_after_ms=math.ceil(wait * 1000))
        if w is None:
            w = self.residency.place(rec, self._takers(rec))
            if w is None:
                return  # no live worker: a restart comes; the request waits, bounded by its deadline
            self.reconcile()
        if rec.key in w.models or rec.last_load_ms is None:   # never loaded: no time to judge the wait by
            return
        left = rec.last_load_ms / 1000 - (self.clock() - w.holding.loading.get(rec.key, self.clock()))
        if left > wait_s:
            raise fail(Code.MODEL_NOT_READY, f"{rec.key} loads on demand and is not loaded; its load takes about "
                       f"{rec.last_load_ms:.0f} ms, more than this request's {wait_s * 1000:.0f} ms timeout allows: "
                       "retry in a moment or allow a longer timeout", model=rec.model, version=rec.version,
                       reason="loading", load_ms=round(rec.last_load_ms, 1), retry_after_ms=math.ceil(left * 1000))

    def resident(self, rec: VersionRecord) -> bool:
        """A live worker has it loaded and takes batches of it."""
        return any(rec.key in w.models and rec.key not in w.holding.evicting for w in self.live())

    def holds_anywhere(self, key: str) -> bool:
        return any(key in w.models or key in w.holding.loading or key in w.holding.unloading for w in self.roster)

    # ---- worker messages ---------------------------------------------------------------------

    def on_loader_hello(self, w: WorkerHandle, msg: LoaderHello) -> None:
        w.loader_said_hello()
        self.reconcile()

    def on_loaded(self, w: WorkerHandle, msg: ModelLoaded) -> None:
        rec = self.registry.record(msg.key)
        if msg.error is not None:
            started = w.load_failed(msg.key)
            log.error("%s failed to load %s (%s): %s", w.name, msg.key, msg.reason, msg.error.replace("\n", "; "),
                      extra={"event": "model_load_failed", "worker": w.name, "key": msg.key, "reason": msg.reason,
                             "error": msg.error})
            self.note("load_failed", msg.key, w, reason=msg.reason, message=msg.error[:300])
            if rec is not None:
                rec.load_failed(f"{msg.reason}: {msg.error}", self.clock())
            if msg.key in self.watching:
                self.failures.setdefault(msg.key, []).append((w, msg))
            else:
                self.on_failed(msg.key, msg.reason, msg.error)
        else:
            started = w.loaded(msg.key, msg.bytes, msg.footprint, self.clock())
            if rec is not None:
                rec.loaded(msg.bytes, msg.load_ms, msg.footprint)
            replay = {"replay": as_builtins(msg.replay)} if msg.replay is not None else {}
            self.note("load", msg.key, w, ms=round(msg.load_ms, 1), bytes=msg.bytes, rss_before=msg.rss_before,
                      rss_after=msg.rss_after, footprint=self.residency.size(w, msg.key), **replay)
            self.residency.settle(w, msg.key)
            log.info("%s loaded %s in %.0f ms (%d bytes)%s", w.name, msg.key, msg.load_ms, msg.bytes,
                     f"; {summary(replay['replay'])}" if replay else "",
                     extra={"event": "model_load", "worker": w.name, "key": msg.key, "load_ms": round(msg.load_ms, 1),
                            "bytes": msg.bytes, **replay})
            self.on_resize(w)
        if started is None:
            log.warning("%s: load answer for %s that was not asked of this life", w.name, msg.key)
        self.reconcile()

    def forget_failed(self, w: WorkerHandle, key: str, error: str) -> None:
        """A restarted worker could not load a version it held before (its file changed or went):
        the version is dropped, so the next start loads the others instead of failing again."""
        rec = self.registry.record(key)
        if rec is None:
            return
        self.registry.forget(rec.model, [rec.version])
        log.error("%s dropped: %s could not load it again after a restart", key, w.name,
                  extra={"event": "model_dropped", "worker": w.name, "key": key})
        self.note("load_failed", key, w, reason="restart", message=error[:300])
        self.on_failed(key, "restart", error)
        self.reconcile()

    def on_unloaded(self, w: WorkerHandle, msg: ModelUnloaded) -> None:
        freed = w.unloaded(msg.key)
        self.note("unload", msg.key, w, bytes=freed, rss_before=msg.rss_before, rss_after=msg.rss_after)
        log.info("%s unloaded %s (RSS %d -> %d MiB)", w.name, msg.key, msg.rss_before >> 20, msg.rss_after >> 20,
                 extra={"event": "model_unload", "worker": w.name, "key": msg.key, "bytes": freed,
                        "rss_before": msg.rss_before, "rss_after": msg.rss_after})
        self.on_resize(w)
        self.reconcile()

    def workers_of(self, key: str) -> dict[str, str]:
        """Worker name -> what it is doing with this version (only those that have anything to do with it)."""
        out = {}
        for w in self.roster:
            h = w.holding
            state = ("unloading" if key in h.unloading else "evicting" if key in h.evicting else
                     "loaded" if key in w.models else "loading" if key in h.loading else "")
            if state:
                out[w.name] = state
        return out

    # ---- waiting -----------------------------------------------------------------------------

    def drained(self, rec: VersionRecord) -> None:
        """A draining version's last admitted request left: a rollout waiting on it looks again."""
        self.wake()

    def wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(None)

    async def until(self, condition: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until `condition()` holds (checked after every change); False at the timeout."""
        deadline = self.clock() + timeout_s
        while not condition():
            left = deadline - self.clock()
            if left <= 0:
                return False
            f = asyncio.get_running_loop().create_future()
            self._waiters.append(f)
            try:
                await asyncio.wait_for(f, min(left, 1.0))  # re-checked each second: a death may change it
            except asyncio.TimeoutError:
                pass
        return True
