"""Read-only answers about the broker: hello, models, health, stats, status, metrics.

Built from the state the broker owns (registry, worker roster, queues, counters); nothing here
changes it.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from tgw.shm.wire import PROTOCOL_VERSION, Health, HealthReply, Hello, HelloReply, ListModels, ModelsReply, Scrape, \
    ScrapeReply, Stats, StatsReply, Status, StatusReply, as_builtins, model_key

from tgw.broker.state.pool import WorkerState
from tgw.broker.models.registry import ModelEntry

if TYPE_CHECKING:
    from tgw.broker.server import Broker

SERVER_NAME = "tgw/0.1.0"


def hello(b: "Broker", req_id: int) -> HelloReply:
    return HelloReply(v=PROTOCOL_VERSION, id=req_id, server=SERVER_NAME, max_request_bytes=b.admission.max_request)


def serving(b: "Broker", m: ModelEntry) -> bool:
    """Requests that name no version can be served now: a live, ready worker has the default
    version loaded (an on-demand model: a live worker could load it)."""
    version = m.default
    if version is None:
        return False
    live = [w for w in b.roster if w.state is WorkerState.READY]
    key = model_key(m.name, version)
    return bool(live) if m.on_demand else any(key in w.models for w in live)


def listed(b: "Broker") -> list[ModelEntry]:
    return [m for m in b.registry.models.values() if not m.removed]


def models(b: "Broker", req_id: int) -> ModelsReply:
    return ModelsReply(v=PROTOCOL_VERSION, id=req_id, models=[m.info(serving(b, m)) for m in listed(b)])


def health(b: "Broker", req_id: int = 0) -> HealthReply:
    ready_models = {m.name: serving(b, m) for m in listed(b)}
    return HealthReply(v=PROTOCOL_VERSION, id=req_id, live=True, ready=b.is_serving() and all(ready_models.values()),
                       models=ready_models, workers={w.name: w.state.value for w in b.roster})


def stats(b: "Broker", req_id: int) -> StatsReply:
    models, now, adm = {}, b.clock(), b.admission
    for name, counters in b.stats.models.items():
        limit = adm.limits.get(name)
        models[name] = {**counters.as_dict(), "queued": b.batcher.queued(name),
                        "queued_by_priority": b.batcher.queued_by_level(name), "cost_model": b.costs.as_dict(name),
                        "concurrency": limit.as_dict() if limit is not None else None,
                        "breakers": adm.breakers.as_dict(name, now), "versions": versions(b, name)}
    seen = b.complaints.as_dict()
    return StatsReply(v=PROTOCOL_VERSION, id=req_id, models=models, processes=processes(b),
                      tenants=adm.tenants.as_dict(),
                      errors=dict(b.stats.unrouted_errors), refused=seen.get("refused", {}),
                      dropped=seen.get("dropped", {}), abandoned=_abandoned(b),
                      clients={"connected": b.callers.connected, "max_clients": b.callers.max_clients,
                               "denied": b.callers.denied, "owed": sum(b.callers.owed.values())},
                      regions=_regions(b))


def versions(b: "Broker", model: str) -> dict:
    """Each version as metadata shows it (state, weight, loads, evictions, what each worker
    holds), and its requests admitted and not yet answered."""
    entry = b.registry.models.get(model)
    return {v: {**as_builtins(r.info(b.placement.workers_of(r.key))), "active": r.active}
            for v, r in entry.records.items()} if entry else {}


def processes(b: "Broker") -> list[dict]:
    return [{"role": "broker", "pid": os.getpid(), "device": ""}] + [
        {"role": "worker", "pid": w.pid, "device": w.device, "state": w.state.value, "inflight": len(w.inflight)}
        for w in b.roster]


def status(b: "Broker", req_id: int) -> StatusReply:
    now = b.clock()
    models = {}
    for m in listed(b):
        c = b.stats.models[m.name]
        models[m.name] = {"default_version": m.default, "versions": {v: r.state.value for v, r in m.records.items()},
                          "weights": {v: r.weight for v, r in m.records.items() if r.weight},
                          "residency": m.decl.residency, "ready": serving(b, m), "queued": b.batcher.queued(m.name),
                          "requests": c.requests, "replies": c.replies, "errors": dict(c.errors)}
    return StatusReply(v=PROTOCOL_VERSION, id=req_id, phase=b.phase.value, uptime_s=round(now - b.started_at, 3),
                       workers=[worker_status(w, now) for w in b.roster], models=models,
                       snapshots=list(b.memory.snapshots.recent),
                       reload=dict(b.operator.reloader.outcome) if b.operator else {},
                       events=list(b.placement.events), http=b.http.address if b.http else "")


def worker_status(w, now: float) -> dict:
    out = {"name": w.name, "pid": w.pid, "device": w.device, "state": w.state.value, "models": sorted(w.models),
           "inflight": len(w.inflight), "restarts": w.restarts, "last_death": w.last_death, "benched": w.benched,
           "heartbeat_age_s": round(now - w.beat_at, 3) if w.beat is not None else None,
           "model_bytes": sum(w.sizes.get(k, 0) for k in w.models), "budget": w.budget}
    if w.beat is not None:
        beat = w.beat
        out.update(rss=beat.rss, cpu_s=round(beat.cpu_s, 3), fds=beat.fds, threads=beat.threads,
                   batches=beat.batches, busy_s=round(now - beat.batch_since, 3) if beat.batch_id is not None else 0.0)
        if beat.cuda_reserved:
            out.update(cuda_allocated=beat.cuda_allocated, cuda_reserved=beat.cuda_reserved)
        out.update(gpu_status(w))
    return out


def gpu_status(w) -> dict:
    """A GPU worker's `gpu` (its device's figures from NVML at its last heartbeat: a dict with
    a None per figure the device does not report, or None where NVML cannot say) and `gpu_ooms`;
    {} for a CPU worker and before the first heartbeat. /metrics (metrics_gpu.py) shows the same."""
    beat = w.beat
    if beat is None:
        return {}
    if not w.device.startswith("cuda"):   # out-of-memory on a CPU worker: only a custom op raises one
        return {"gpu_ooms": beat.gpu_ooms} if beat.gpu_ooms else {}
    return {"gpu": as_builtins(beat.gpu) if beat.gpu is not None else None, "gpu_ooms": beat.gpu_ooms}


def scrape(b: "Broker", req_id: int) -> ScrapeReply:
    """What GET /metrics serves (broker/observe/metrics.py), for `tgw-broker metrics`."""
    return ScrapeReply(v=PROTOCOL_VERSION, id=req_id, text=b.metrics.render()[0].decode())


# the read-only ops, by request type: each answers (broker, request id)
ANSWERS = {Hello: hello, ListModels: models, Health: health, Stats: stats, Status: status, Scrape: scrape}


def _abandoned(b: "Broker") -> dict:
    door = getattr(b, "door", None)   # None until the broker is attached to its sockets
    return dict(door.abandon.counts) if door is not None else {}


def _regions(b: "Broker") -> dict:
    door = getattr(b, "door", None)   # None until the broker is attached to its sockets
    return door.regions.as_dict() if door is not None else {}
