"""Read-only answers about the broker: hello, models, health, stats, status, metrics.

Built from the state the broker owns (registry, worker roster, queues, counters), as a
BrokerView hands it over; nothing here changes it.
"""
from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from tgw.shm import gc_watch
from tgw.shm.wire import PROTOCOL_VERSION, Health, HealthReply, Hello, HelloReply, ListModels, ModelsReply, Scrape, \
    ScrapeReply, Stats, StatsReply, Status, StatusReply, as_builtins, model_key

from tgw.broker.sequence.counters import SequenceCounters
from tgw.broker.state.generation import GeneratorCounters
from tgw.broker.state.pool import WorkerState
from tgw.broker.state.versions import VersionState
from tgw.broker.models.registry import ModelEntry
from .devices import device_states

if TYPE_CHECKING:
    from tgw.broker.front.callers import Callers
    from tgw.broker.pipeline.executor import Pipelines
    from tgw.broker.pipeline.plan import Plan
    from tgw.broker.sched.batcher import Batcher
    from tgw.broker.sched.breaker import Breakers
    from tgw.broker.sched.costmodel import CostModel
    from tgw.broker.sched.tenants import Tenants
    from tgw.broker.state.complaints import Complaints
    from tgw.broker.state.stats import Stats as Counters

SERVER_NAME = "tgw/0.1.0"
READY_PHASE = "serving"   # the one phase health calls ready (not "draining": the notice hides it)
NO_FRONTS = {"configured": 0, "alive": 0, "restarts": 0, "ready": True, "public": {}, "lives": []}


@dataclass
class Listening:
    """Where each face listens: written once per face by the core as the face starts ("": off)."""
    http: str = ""
    grpc: str = ""
    torchserve: str = ""   # "INFERENCE MANAGEMENT" addresses


@dataclass(frozen=True)
class BrokerView:
    """What the read-only answers read of the broker: this module's, /metrics' (metrics*.py) and
    the faces' health and repository. The core's assembly fills it in, from parts built before it;
    the callables are those parts' own methods, read at call time."""
    clock: Callable[[], float]
    started_at: float
    phase: Callable[[], str]            # the phase's value: "starting", "serving", "draining" or "stopping"
    phases: tuple[str, ...]             # every phase's value, in order (tgw_broker_phase's one-hot)
    is_serving: Callable[[], bool]      # serving or draining: requests are taken and served
    roster: list                        # every worker (pool.WorkerHandle), in any state
    models: dict[str, ModelEntry]       # the registry's entries by name, removed ones too
    stats: "Counters"
    batcher: "Batcher"                  # queued requests, by model and priority
    costs: "CostModel"
    complaints: "Complaints"            # refusals and dropped replies, counted
    callers: "Callers"                  # client connections
    max_request: int                    # server.max_request_bytes, as admission enforces it
    limits: dict                        # admission's adaptive concurrency limits, by model
    breakers: "Breakers"
    tenants: "Tenants"
    workers_of: Callable[[str], dict]   # placement: what each worker holds of a version
    events: deque                       # placement's recent lifecycle events
    snapshots: Callable[[], list]       # the memory snapshots written lately
    reload: dict                        # the last reload's outcome (the reloader writes it; {} before one)
    listening: "Listening"              # where the faces listen
    abandoned: Callable[[], dict]       # the front door's abandoned requests by reason ({} before it opens)
    regions: Callable[[], dict]         # the front door's shared-memory regions
    pipelines: "Pipelines"              # the pipelines served (their table, counters)
    cancelled: Callable[[], dict] = dict   # withdrawn requests: model -> where -> n (front/abandon.py)
    faults: Callable[[], dict] = dict      # sticky CUDA errors (fleet/faults.py CudaFaults.as_dict)
    rollouts: Callable[[], dict] = dict    # shadows and guarded rollouts (canary/guards.py Guards.status)
    replay: Callable[[str], dict] = lambda model: {}   # its replay warm-up sample (models/replay.py as_dict)
    jobs: Callable[[], dict] = dict        # polled jobs held and their counts (jobs/store.py JobStore.as_dict)
    # each generator model's counters, by name (the generate wing's; none counted yet: absent)
    generators: dict[str, GeneratorCounters] = field(default_factory=dict)
    # each sequence model's counters, by name (the sequence wing's; none counted yet: absent)
    sequences: dict[str, SequenceCounters] = field(default_factory=dict)
    # the front processes (broker/fronts/fleet.py FrontFleet.as_dict): configured, alive, restarts,
    # ready (health: one serves), lives; none configured: NO_FRONTS
    fronts: Callable[[], dict] = lambda: dict(NO_FRONTS)


def hello(view: BrokerView, req_id: int) -> HelloReply:
    return HelloReply(v=PROTOCOL_VERSION, id=req_id, server=SERVER_NAME, max_request_bytes=view.max_request,
                      max_inflight_per_client=view.callers.owed.max_owed)


def serving(view: BrokerView, m: ModelEntry, fallback: bool = True) -> bool:
    """Requests that name no version can be served now: a live, ready worker has the default
    version loaded (an on-demand model: a live worker could load it), and its circuit breaker
    lets requests through - or, while it is open, the model's fallback can serve them."""
    version = m.default
    if version is None:
        return False
    if not held(view, m, model_key(m.name, version)):
        return False
    return not refused(view, m.name, version) or (fallback and fallback_serving(view, m.name))


def version_serving(view: BrokerView, m: ModelEntry, version: str) -> bool:
    """That version is ready, a live, ready worker has it (on demand: could load it), and its
    breaker (or the model's fallback) lets requests through."""
    rec = m.records.get(version)
    if rec is None or rec.state is not VersionState.READY:
        return False
    if not held(view, m, model_key(m.name, version)):
        return False
    return not refused(view, m.name, version) or fallback_serving(view, m.name)


def held(view: BrokerView, m: ModelEntry, key: str) -> bool:
    """A live worker takes batches of that version: a ready one, or one still starting that has
    it in already (pool.py offers); an on-demand version: any ready worker could load it."""
    if m.on_demand:
        return any(w.state is WorkerState.READY for w in view.roster)
    return any(w.offers(key) for w in view.roster)


def loading(view: BrokerView, m: ModelEntry, now: float) -> list[dict]:
    """The model's versions loading on workers now, start-up loads included: each with its
    worker, phase (queued: a start-up load waiting its turn; loading, warming) and seconds so far."""
    return [{"version": version, "worker": w.name, "phase": load.phase, "seconds": round(now - load.since, 3)}
            for w in view.roster for key, load in sorted(w.under_way.items())
            for name, _, version in [key.partition(":")] if name == m.name]


def refused(view: BrokerView, model: str, version: str) -> bool:
    """Its breaker is open and still cooling down: every request to it is refused now (once the
    cooldown is over, the next request is let through as a probe)."""
    breaker = view.breakers.get(model, version) if view.breakers.by_key else None
    return breaker is not None and breaker.retry_after_s(view.clock()) > 0


def fallback_serving(view: BrokerView, model: str) -> bool:
    """The model's breaker fallback can serve (one step: admission follows no fallback's fallback)."""
    name = view.breakers.fallback.get(model)
    target = view.models.get(name) if name is not None else None
    return target is not None and not target.removed and serving(view, target, fallback=False)


def pipeline_ready(view: BrokerView, plan: "Plan") -> bool:
    """Every step can be served now: its model (its pinned version) as `serving` says."""
    for step in plan.steps:
        m = view.models.get(step.model)
        if m is None or m.removed or not (serving(view, m) if step.version is None
                                          else version_serving(view, m, step.version)):
            return False
    return True


def listed(view: BrokerView) -> list[ModelEntry]:
    return [m for m in view.models.values() if not m.removed]


def models(view: BrokerView, req_id: int) -> ModelsReply:
    """The models, then the pipelines."""
    return ModelsReply(v=PROTOCOL_VERSION, id=req_id, models=[m.info(serving(view, m)) for m in listed(view)] + [
        plan.info(pipeline_ready(view, plan)) for plan in view.pipelines.table.values()])


def health(view: BrokerView, req_id: int = 0) -> HealthReply:
    """Live: the loop answers. Ready: serving (not starting, not in the drain notice, not
    stopping), every model servable now (`serving`: a ready worker holds its default version
    and its breaker lets requests through) and, with front processes, one of them serving; each
    device's state beside (devices.py).
    docs/OPERATIONS.md#health-readiness-and-load."""
    ready_models = {m.name: serving(view, m) for m in listed(view)}
    return HealthReply(v=PROTOCOL_VERSION, id=req_id, live=True,
                       ready=view.phase() == READY_PHASE and all(ready_models.values()) and view.fronts()["ready"],
                       models=ready_models, workers={w.name: w.state.value for w in view.roster},
                       devices=device_states(view))


def stats(view: BrokerView, req_id: int) -> StatsReply:
    models, now = {}, view.clock()
    for name, counters in view.stats.models.items():
        limit = view.limits.get(name)
        models[name] = {**counters.as_dict(), "queued": view.batcher.queued(name),
                        "queued_by_priority": view.batcher.queued_by_level(name),
                        "cost_model": view.costs.as_dict(name),
                        "concurrency": limit.as_dict() if limit is not None else None,
                        "breakers": view.breakers.as_dict(name, now), "versions": versions(view, name)}
    seen = view.complaints.as_dict()
    return StatsReply(v=PROTOCOL_VERSION, id=req_id, models=models, processes=processes(view),
                      tenants=view.tenants.as_dict(),
                      errors=dict(view.stats.unrouted_errors), refused=seen.get("refused", {}),
                      dropped=seen.get("dropped", {}), abandoned=view.abandoned(),
                      clients={"connected": view.callers.connected, "max_clients": view.callers.max_clients,
                               "denied": view.callers.denied, "owed": view.callers.owed.total()},
                      regions=view.regions(), cancelled=view.cancelled())


def versions(view: BrokerView, model: str) -> dict:
    """Each version as metadata shows it (state, weight, loads, evictions, what each worker
    holds), and its requests admitted and not yet answered."""
    entry = view.models.get(model)
    return {name: {**as_builtins(r.info(view.workers_of(r.key))), "active": r.active}
            for name, r in entry.records.items()} if entry else {}


def processes(view: BrokerView) -> list[dict]:
    return [{"role": "broker", "pid": os.getpid(), "device": ""}] + [
        {"role": "worker", "pid": w.pid, "device": w.device, "state": w.state.value, "inflight": len(w.inflight),
         "host_memory": w.host_memory}
        for w in view.roster]


def status(view: BrokerView, req_id: int) -> StatusReply:
    now = view.clock()
    models = {}
    for m in listed(view):
        c = view.stats.models[m.name]
        models[m.name] = {"default_version": m.default, "versions": {n: r.state.value for n, r in m.records.items()},
                          "weights": {n: r.weight for n, r in m.records.items() if r.weight},
                          "residency": m.decl.residency, "ready": serving(view, m),
                          "queued": view.batcher.queued(m.name),
                          "requests": c.requests, "replies": c.replies, "errors": dict(c.errors),
                          "replay": view.replay(m.name), "loading": loading(view, m, now),
                          "cache": m.cache.as_dict() if m.cache is not None else None,
                          "generation": generation(view, m), "sequences": sequences(view, m)}
    return StatusReply(v=PROTOCOL_VERSION, id=req_id, phase=view.phase(), uptime_s=round(now - view.started_at, 3),
                       workers=[worker_status(w, now) for w in view.roster], models=models,
                       snapshots=list(view.snapshots()), reload=dict(view.reload), events=list(view.events),
                       http=view.listening.http, grpc=view.listening.grpc,
                       torchserve=view.listening.torchserve, devices=device_states(view),
                       cuda_faults=view.faults(), rollouts=view.rollouts(), jobs=view.jobs(), fronts=view.fronts(),
                       pipelines=view.pipelines.as_dict(lambda plan: pipeline_ready(view, plan)),
                       gc=gc_figures(view))


def gc_figures(view: BrokerView) -> dict:
    """status' `gc`: this process's collection figures and each worker's from its last heartbeat
    (docs/OPERATIONS.md#garbage-collection); a worker not yet beating is absent."""
    return {"broker": gc_watch.watch.as_dict(),
            "workers": {str(w.worker_id): w.beat.gc for w in view.roster if w.beat is not None and w.beat.gc}}


def generator_counters(view: BrokerView, m: ModelEntry) -> GeneratorCounters | None:
    """A generator model's counters (zeros before the generate wing counted any); None for another model."""
    counters = view.generators.get(m.name)
    if counters is None and m.is_generator:
        return GeneratorCounters()
    return counters


def generation(view: BrokerView, m: ModelEntry) -> dict | None:
    """status' models[m]["generation"]: GeneratorCounters.as_dict (docs/GENERATION.md); None: not a generator."""
    counters = generator_counters(view, m)
    return counters.as_dict() if counters is not None else None


def sequence_counters(view: BrokerView, m: ModelEntry) -> SequenceCounters | None:
    """A sequence model's counters (zeros before the sequence wing counted any); None for another model."""
    if m.decl.sequence_batching is None:
        return None
    return view.sequences.get(m.name) or SequenceCounters()


def sequences(view: BrokerView, m: ModelEntry) -> dict | None:
    """status' models[m]["sequences"]: SequenceCounters.as_dict (docs/SEQUENCES.md); None: not a sequence model."""
    counters = sequence_counters(view, m)
    return counters.as_dict() if counters is not None else None


def worker_status(w, now: float) -> dict:
    out = {"name": w.name, "pid": w.pid, "device": w.device, "state": w.state.value, "models": sorted(w.models),
           "inflight": len(w.inflight), "restarts": w.restarts, "last_death": w.last_death, "benched": w.benched,
           "heartbeat_age_s": round(now - w.beat_at, 3) if w.beat is not None else None,
           "model_bytes": sum(w.sizes.get(k, 0) for k in w.models), "budget": w.budget,
           "host_memory": w.host_memory, "role": w.role,   # models, stages or both (roles.py)
           # each held version's memory as measured at its load (docs/MEMORY.md)
           "footprints": {k: {"weights": fp.weights, "activation_peak": fp.activation_peak, "bytes": fp.total,
                              "measured_on": fp.measured_on}
                          for k, fp in sorted(w.footprints.items()) if k in w.models}}
    if w.beat is not None:
        beat = w.beat
        out.update(rss=beat.rss, rss_anon=beat.rss_anon, cpu_s=round(beat.cpu_s, 3), fds=beat.fds,
                   threads=beat.threads, batches=beat.batches,
                   busy_s=round(now - beat.batch_since, 3) if beat.batch_id is not None else 0.0)
        if beat.cuda_reserved:
            out.update(cuda_allocated=beat.cuda_allocated, cuda_reserved=beat.cuda_reserved)
        out.update(gpu_status(w))
    return out


def gpu_status(w) -> dict:
    """A GPU worker's `gpu` (its device's figures from NVML at its last heartbeat: a dict with
    a None per figure the device does not report, or None where NVML cannot say) and `gpu_ooms`;
    {} for a CPU worker and before the first heartbeat. /metrics (metrics.py gpu_families) shows the same."""
    beat = w.beat
    if beat is None:
        return {}
    if not w.device.startswith("cuda"):   # out-of-memory on a CPU worker: only a custom op raises one
        return {"gpu_ooms": beat.gpu_ooms} if beat.gpu_ooms else {}
    return {"gpu": as_builtins(beat.gpu) if beat.gpu is not None else None, "gpu_ooms": beat.gpu_ooms}


# the read-only ops, by request type: each answers (view, request id)
ANSWERS = {Hello: hello, ListModels: models, Health: health, Stats: stats, Status: status}


class ReadOnlyAnswers:
    """The front door's answers to read-only ops: ANSWERS over the view, and the metrics
    exposition (what GET /metrics serves, for `tgw-broker metrics`) from `scrape`."""

    def __init__(self, view: BrokerView, scrape: Callable[[], tuple[bytes, str]]):
        self.view, self.scrape = view, scrape

    def answer(self, msg):
        if type(msg) is Scrape:
            return ScrapeReply(v=PROTOCOL_VERSION, id=msg.id, text=self.scrape()[0].decode())
        return ANSWERS[type(msg)](self.view, msg.id)
