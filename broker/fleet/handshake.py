"""The broker's half of each worker's life on the socket: hello, load, ready, failed, lost.

hello  → the broker answers with the versions to load now: every version of each
         always-resident model as served now (runtime loads included; on-demand ones load
         when asked for, through the worker's loader thread) that its role holds
         (models/roles.py: models, stages or both);
ready  → the worker serves those versions (routing may use it);
failed → a model did not load or warm up: start-up fails with the worker's reason;
lost   → the process died: its in-flight requests are retried once elsewhere, the rest
         answered WORKER_DIED.
"""
from __future__ import annotations

import logging
from typing import Callable

from tgw.shm.errors import Code, TgwError, fail
from tgw.shm.wire import LoadModels, WorkerFailed, WorkerHello, WorkerReady

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

    def hello(self, w: WorkerHandle, msg: WorkerHello) -> LoadModels:
        w.introduced(msg.pid, msg.device_uuid, msg.device_memory, msg.host_memory)
        if self.budget is not None:
            w.budgeted(self.budget(w))
        return LoadModels(models=[s for s in self.registry.startup_specs()
                                  if serves(w.role, w.device, s.format == "stage", s.device)])

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
