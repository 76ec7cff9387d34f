"""The broker's half of each worker's life on the socket: hello, load, ready, failed, lost.

hello  → the broker answers with the versions to load now: every version of each
         always-resident model as served now (runtime loads included; on-demand ones load
         when asked for, through the worker's loader thread) that its role holds
         (models/roles.py: models, stages or both), the smallest first;
loaded → one of them is in, warmed up: it takes batches now, while the others still load
         (the worker's loader thread loads them one by one, its serving loop already runs);
ready  → the worker serves all those versions (the start-up waits for every worker's);
failed → a model did not load or warm up: start-up fails with the worker's reason (once
         serving, that version is dropped), and the worker is stopped;
lost   → the process died: its in-flight requests are retried once elsewhere, the rest
         answered WORKER_DIED.
"""
from __future__ import annotations

import logging
from typing import Callable

from tgw.shm.errors import Code, TgwError, fail
from tgw.shm.wire import LoadModels, ModelLoaded, WorkerFailed, WorkerHello, WorkerReady, model_key

from tgw.broker.state.pending import Pending
from tgw.broker.state.pool import WorkerHandle, WorkerState
from tgw.broker.models.registry import Registry
from tgw.broker.models.roles import serves

log = logging.getLogger("tgw.broker")


class Handshake:
    def __init__(self, registry: Registry, serving: Callable[[], bool] = lambda: False,
                 lost_version: Callable[[WorkerHandle, str, str], None] = lambda w, key, error: None,
                 budget: Callable[[WorkerHandle], int | None] | None = None):
        self.registry = registry
        self.failure: str | None = None  # the first load failure, which fails start-up
        self.serving = serving            # once serving, a restarted worker's failed load ...
        self.lost_version = lost_version  # ... drops that version instead (placement.forget_failed)
        self.budget = budget              # a worker's model budget, once its hello gave its device's size
        # the lifecycle's: start-up waits on these (and on the processes' exits), no interval
        self.on_ready: Callable[[WorkerHandle], None] = lambda w: None
        self.on_failed: Callable[[WorkerHandle], None] = lambda w: None

    def hello(self, w: WorkerHandle, msg: WorkerHello, now: float) -> LoadModels:
        w.introduced(msg.pid, msg.device_uuid, msg.device_memory, msg.host_memory)
        if self.budget is not None:
            w.budgeted(self.budget(w))
        specs = [s for s in self.registry.startup_specs() if serves(w.role, w.device, s.format == "stage", s.device)]
        specs.sort(key=self._bytes)   # the smallest first: each serves once in
        w.loads_queued([model_key(s.name, s.version) for s in specs], now)   # status shows them waiting their turn
        return LoadModels(models=specs)

    def _bytes(self, spec) -> int:
        """A version's weight bytes as last measured, else its file's size (a stage's: 0)."""
        rec = self.registry.record(model_key(spec.name, spec.version))
        return rec.param_bytes() if rec is not None else 0

    def model_loaded(self, w: WorkerHandle, msg: ModelLoaded) -> bool:
        """One start-up model is in: True if the worker takes batches of it now."""
        if w.state is not WorkerState.STARTING or msg.error is not None:   # a failure: WorkerFailed tells it
            return False
        w.started_serving(msg.key, msg.bytes, msg.footprint)
        rec = self.registry.record(msg.key)
        if rec is not None:
            rec.served_by(msg.bytes, msg.footprint)
        log.info("%s loaded %s in %.0f ms (%d bytes)", w.name, msg.key, msg.load_ms, msg.bytes,
                 extra={"event": "startup_load", "worker": w.name, "key": msg.key, "load_ms": round(msg.load_ms, 1),
                        "warm_ms": round(msg.warm_ms, 1), "bytes": msg.bytes})
        return True

    def ready(self, w: WorkerHandle, msg: WorkerReady, now: float) -> bool:
        """True if the worker now serves; a worker told to stop meanwhile stays stopping."""
        if w.state is not WorkerState.STARTING:
            log.info("%s ready while %s: ignored", w.name, w.state.value)
            return False
        w.became_ready(msg.models, now, msg.sizes, msg.footprints)
        for key in msg.models:
            rec = self.registry.record(key)
            if rec is not None:
                rec.served_by(msg.sizes.get(key, 0), msg.footprints.get(key))
        log.info("%s ready with %s", w.name, ", ".join(msg.models),
                 extra={"event": "worker_ready", "worker": w.name, "pid": w.pid, "models": msg.models})
        self.on_ready(w)
        return True

    def failed(self, w: WorkerHandle, msg: WorkerFailed) -> None:
        reason = f"{w.name} failed to load model {msg.model}: {msg.error}"
        if self.serving() or self.failure is not None:   # the first at start-up is the start's failure line
            log.error("%s", reason.replace("\n", "; "), extra={"event": "model_load_failed", "worker": w.name,
                                                                "key": msg.model, "error": msg.error})
        if self.serving() and self.registry.record(msg.model) is not None:
            self.lost_version(w, msg.model, msg.error)   # else every restart would fail the same way
        else:
            self.failure = self.failure or reason
        self.on_failed(w)

    @staticmethod
    def lost(w: WorkerHandle, retry: bool) -> tuple[list[Pending], list[Pending]]:
        """Split a dead worker's in-flight requests into (retry now, answer WORKER_DIED).

        Each is retried once and alone (a batch of one), so a poison request cannot take the
        requests batched with it down again; one that was in flight at two deaths is likely
        the cause, is never run again, and its fingerprint is logged."""
        again, gone = [], []
        for batch in w.drop_inflight():
            for p in batch.requests:
                p.attempts += 1
                if p.attempts >= 2:
                    log.error("request in flight at two worker deaths, not retried: %s", fingerprint(p),
                              extra={"event": "poison_request", "request_id": p.req_id, "model": p.model,
                                     "version": p.version, "trace_id": p.trace[3:35] if p.trace else None})
                if retry and p.attempts == 1:
                    p.alone = True
                    again.append(p)
                else:
                    gone.append(p)
        return again, gone


def death_error(w: WorkerHandle, p: Pending) -> TgwError:
    """The answer to a request given up after `lost`: a likely poison at its second death."""
    fault = {"cuda_fault": True} if w.faulted else {}
    if p.attempts >= 2:
        return fail(Code.WORKER_DIED, f"in flight at {p.attempts} worker deaths ({w.name}: {w.last_death}); "
                    "not run again: it is likely what kills them", worker_deaths=p.attempts, poison=True, **fault)
    return fail(Code.WORKER_DIED, f"{w.name} died while running this request ({w.last_death})",
                worker_deaths=p.attempts, **fault)


def fingerprint(p: Pending) -> str:
    """What identifies a request in the logs without its data."""
    shapes = f"variable dims {list(p.shape_key)}" if p.shape_key else "fixed dims"
    return (f"model={p.model} version={p.version} rows={p.rows} {shapes} "
            f"input_bytes={p.nbytes} client={p.client.hex() if type(p.client) is bytes else p.client} id={p.req_id}")
