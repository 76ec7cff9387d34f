"""The narrow records the core hands each wing: built here from the Broker, so no wing sees it.

Each wing declares the record of what it reads and calls (front.frontdoor.DoorDeps, ...); the
functions here fill them in (`b`: the server.Broker; not imported, as server imports this).
Attributes the core may replace later (the operator, the HTTP face) are read through lambdas, at
call time.
"""
from __future__ import annotations

from tgw.shm.wire import PROTOCOL_VERSION, Cancel

from tgw.broker.canary.policy import checked
from tgw.broker.front.frontdoor import DoorDeps
from tgw.broker.protocol.door import DoorPort
from tgw.broker.protocol.triton_shm import TritonShm
from tgw.broker.models.guarded import GuardHooks
from tgw.broker.models.operator import OperatorDeps
from tgw.broker.models.reload import ReloadDeps
from tgw.broker.models.rollout import RolloutDeps
from tgw.broker.observe import status
from tgw.broker.observe.load import LoadReport
from tgw.broker.observe.status import BrokerView
from tgw.broker.pipeline.executor import PipelineDeps


def door_deps(b) -> DoorDeps:
    a = b.admission
    return DoorDeps(server=b.server, token=b.token, clock=b.clock, complaints=b.complaints, callers=b.callers,
                    stats=b.stats, roster=b.roster, models=b.registry.models, admit=a.admit, finished=a.finished,
                    leave=a.leave,
                    on_finished=a.on_finished, batcher=b.batcher, schedule=b.schedule, flush=b.flush,
                    query=lambda msg: status.ANSWERS[type(msg)](b.view, msg.id), operate=b.operate,
                    snapshot=lambda msg, answer: b.memory.request(b.roster, msg, b.clock(), answer),
                    pipelines=b.pipelines, withdraw=b.withdraw, answered=b.shadows.sample)


def pipeline_deps(b) -> PipelineDeps:
    """Built before the broker is attached to its sockets: the door is read at call time."""
    return PipelineDeps(models=b.registry.models, clock=b.clock,
                        infer=lambda ident, msg, frames: b.door.infer(ident, msg, frames),
                        reply=lambda ident, msg, *frames: b.door.reply(ident, msg, *frames),
                        cancel_step=lambda caller, req_id: b.door.abandon.cancel(
                            caller, Cancel(v=PROTOCOL_VERSION, id=0, ids=[req_id])),
                        callers=b.callers, tenants=b.admission.tenants, is_open=lambda: b.admission.open,
                        note=b.complaints.note)


def pipeline_ready(b):
    """Whether a pipeline can be served now (every step's model or pinned version), by the view."""
    return lambda plan: status.pipeline_ready(b.view, plan)


def observe_view(b) -> BrokerView:
    """The read-only answers' view (status, /metrics, the HTTP face's health); built once the
    phase and start time are set. The door, operator and HTTP face come later: read at call time."""
    a, p = b.admission, b.placement
    return BrokerView(clock=b.clock, started_at=b.started_at, phase=lambda: b.phase.value,
                      phases=tuple(ph.value for ph in type(b.phase)), is_serving=b.is_serving, roster=b.roster,
                      models=b.registry.models, stats=b.stats, batcher=b.batcher, costs=b.costs,
                      complaints=b.complaints, callers=b.callers, max_request=a.max_request, limits=a.limits,
                      breakers=a.breakers, tenants=a.tenants, workers_of=p.workers_of, events=p.events,
                      snapshots=lambda: b.memory.snapshots.recent,
                      reload=lambda: dict(b.operator.reloader.outcome) if b.operator else {},
                      http_address=lambda: b.http.address if b.http else "",
                      grpc_address=lambda: b.grpc.address if getattr(b, "grpc", None) else "",
                      abandoned=_door(b, lambda door: dict(door.abandon.counts)),
                      cancelled=_door(b, lambda door: door.abandon.cancelled_by_model()),
                      regions=_door(b, lambda door: door.regions.as_dict()), scrape=lambda: b.metrics.render(),
                      pipelines=b.pipelines, latencies=lambda: {m: s.e2e for m, s in b.metrics.series.items()},
                      faults=b.faults.as_dict, rollouts=b.guards.status, replay=b.replay.as_dict)


def _door(b, read):
    """`read` of the front door; {} until the broker is attached to its sockets (no door yet)."""
    return lambda: read(b.door) if getattr(b, "door", None) is not None else {}


def face_deps(b) -> DoorPort:
    """The HTTP face's record: after attach, as the front door's methods are bound here."""
    return DoorPort(token=b.token, view=b.view, entry=b.registry.entry, dispatch=b.door.dispatch,
                    infer=b.door.infer, count_error=b.stats.error, note=b.complaints.note,
                    withdraw=lambda caller, reason: b.door.abandon.drop_caller({caller}, reason), shm=client_shm(b),
                    load=load_report(b))


def load_report(b) -> LoadReport:
    """The one load report (observe/load.py): the faces attach its header, the lifecycle
    refreshes it on each periodic look; made on first use."""
    report = getattr(b, "load", None)
    if report is None:
        report = b.load = LoadReport(b.view)
    return report


def client_shm(b) -> TritonShm:
    """The one registry of Triton's client shared memory regions, which the HTTP and gRPC faces
    share (Triton's regions are the server's); made on first use. Each face checks its own
    allow_client_shm, so with both off nothing can register in it."""
    shm = getattr(b, "triton_shm", None)
    if shm is None:
        shm = b.triton_shm = TritonShm(b.server.max_region_bytes, b.roster)
    return shm


def rollout_deps(b) -> RolloutDeps:
    breakers = b.admission.breakers
    return RolloutDeps(registry=b.registry, placement=b.placement, clock=b.clock,
                       declare_breakers=breakers.declare, forget_breakers=breakers.forget,
                       unserved=b.unserved.versions, pipelines_blocking=b.pipelines.blocking,
                       pipeline_metadata=lambda name: b.pipelines.metadata(name, pipeline_ready(b)),
                       guards=guard_hooks(b))


def guard_hooks(b) -> GuardHooks:
    return GuardHooks(check_policy=checked, shadow_of=b.shadows.shadow_of, guarded=b.guards.guarded,
                      start_shadow=b.shadows.start, watch=b.guards.watch, gone=b.guards.gone)


def admit_copy(b):
    """Shadow copies (canary/shadow.py) into the queues; the pump is due for each one queued."""
    def admit(p) -> bool:
        queued = b.admission.copies.admit(p)
        if queued:
            b.schedule()
        return queued
    return admit


def decide(b):
    """The guards' verdicts go to the operator (main.py attaches it; none in the test rigs)."""
    def carry_out(*verdict) -> None:
        if b.operator is not None:
            b.operator.decide(*verdict)
    return carry_out


def reload_deps(b) -> ReloadDeps:
    def declare(m) -> None:   # what the Broker does for each configured model at start, and admission
        b.batcher.declare(m)
        b.stats.model(m.name)
        b.admission.declare(m)

    def set_max_queue(name: str, n: int) -> None:
        b.batcher.queues[name].max_queue = n

    return ReloadDeps(registry=b.registry, placement=b.placement, uptime=lambda: b.clock() - b.started_at,
                      declare=declare, set_max_queue=set_max_queue,
                      pipelines=lambda cfg: b.pipelines.configure(cfg.pipelines),
                      warmup=lambda cfg: b.replay.configure(cfg.warmup, [m.name for m in cfg.models]))


def operator_deps(b) -> OperatorDeps:
    """Built before the broker is attached to its sockets: the door is read at call time."""
    return OperatorDeps(rollout=rollout_deps(b), reload=reload_deps(b),
                        reply=lambda ident, msg: b.door.reply(ident, msg), serving=b.is_serving,
                        phase=lambda: b.phase.value)
