"""The one place that builds the broker: every part once, in dependency order, each from the
narrow inputs it reads (a config section, a few keys, other parts' methods).

The order is the data's: the sockets first - the front door, which can answer a request from
the moment it exists, and the link to the workers, which can send - so every later part is
handed the answers (`door.fail`, `door.reply`) and sends it needs as plain methods of parts that
exist. Two parts close a loop and so have a second step here, each once, at the end: the door
opens (starts reading requests) with its routes to the parts behind it, and the worker link
listens with its handler; admission is told who hears of each request's exit. Nothing reads a
part through a lambda or a `getattr` guard waiting for it to exist.
"""
from __future__ import annotations

import asyncio
import time
from functools import partial
from typing import Callable

import zmq

from tgw.broker.canary.guards import Guards
from tgw.broker.canary.policy import checked
from tgw.broker.canary.shadow import Shadows
from tgw.broker.config.load import Config, ModelDecl
from tgw.broker.config.startup import StartupError
from tgw.broker.fleet.faults import CudaFaults
from tgw.broker.fleet.handshake import Handshake
from tgw.broker.fleet.memory import MemoryWatch
from tgw.broker.front.callers import Callers
from tgw.broker.front.frontdoor import DoorRoutes, FrontDoor
from tgw.broker.fronts.directory import DirectoryBook
from tgw.broker.fronts.fleet import FrontFleet
from tgw.broker.fronts.hub import FrontsHub, HubRoutes
from tgw.broker.generate.streams import Streams
from tgw.broker.jobs.jobs import Jobs
from tgw.broker.jobs.store import JobStore
from tgw.broker.faces.http.face import HttpFace
from tgw.broker.faces.openai.face import OpenAiFace
from tgw.broker.torchserve.face import face_for as torchserve_face
from tgw.broker.models.guarded import GuardHooks
from tgw.broker.models.operator import Operator, OperatorDeps
from tgw.broker.models.placement import Placement
from tgw.broker.models.registry import Registry
from tgw.broker.models.reload import ReloadDeps
from tgw.broker.models.replay import ReplayRecorder
from tgw.broker.models.rollout import RolloutDeps
from tgw.broker.observe import logs, status, tracing
from tgw.broker.observe.load import LoadReport
from tgw.broker.observe.metrics import Metrics
from tgw.broker.observe.status import BrokerView, Listening, ReadOnlyAnswers
from tgw.broker.pipeline.executor import PipelineDeps, Pipelines
from tgw.broker.protocol.door import DoorPort
from tgw.broker.protocol.triton_shm import TritonShm
from tgw.broker.protocol.uploads import Uploads
from tgw.broker.sched.admission import Admission
from tgw.broker.sched.batcher import Batcher
from tgw.broker.sched.costmodel import CostModel
from tgw.broker.sched.tenants import Tenants
from tgw.broker.sched.unserved import Unserved, answer_load_failure
from tgw.broker.sequence.binding import Sequences
from tgw.broker.state.complaints import Complaints
from tgw.broker.state.stats import Stats

from .broker import Broker
from .phase import BrokerPhase, Phase
from .serving import Serving, WorkerLink, WorkerMessages


def assemble(cfg: Config, loop: asyncio.AbstractEventLoop, front: zmq.Socket, back: zmq.Socket,
             zap: zmq.Socket | None = None, *, clock: Callable[[], float] = time.monotonic, token: str | None = None,
             max_clients: int | None = None, workers: int = 1, roster: list | None = None, address: str = "",
             config_path: str | None = None, base_dir: str = "/", fronts: zmq.Socket | None = None,
             fronts_count: int = 0, run_dir: str = "") -> Broker:
    """The broker over its bound sockets. `roster`: the supervisor's list of workers, which it
    alone changes (None: a core without a supervisor, as the test rigs make, enrols workers
    itself); `workers`: how many devices serve; `address`: the client address (control ops are
    refused on tcp:// without a token); `config_path`: the file a reload re-reads; `base_dir`:
    relative paths' root (the tracing files); `fronts`: the fronts socket (bound in `run_dir`,
    the broker's private folder), with `fronts_count` front processes to supervise."""
    server, obs = cfg.server, cfg.observability
    # the exit hooks that depend on the config alone first: tracing may refuse to start, and
    # nothing is running yet then
    slow = logs.slow_requests(obs.slow_request_ms)
    tracer = tracing.install(obs.tracing, loop, base_dir)
    phase = BrokerPhase(clock)
    roster_given = roster is not None
    roster = roster if roster_given else []

    # what every request touches: counters, callers, models, queues
    complaints = Complaints(clock)
    callers = Callers(server, max_clients or server.max_clients, clock)
    stats = Stats()
    registry = Registry(cfg.models)
    costs = CostModel()
    batcher = Batcher(clock, costs)
    for m in cfg.models:
        batcher.declare(m)
        stats.model(m.name)
    replay = ReplayRecorder(cfg.warmup)   # each model's recent batches, for versions loaded later

    # the sockets: answers to clients, sends to workers
    door = FrontDoor(loop, front, server, token, clock, complaints, callers, stats, zap)
    link = WorkerLink(loop, back, cfg.workers.doorbell)

    # workers' memory and faults, versions on workers, admission
    memory = MemoryWatch(cfg.supervisor, link.send)
    faults = CudaFaults(cfg.supervisor.cuda_faults, clock, memory.snapshots.write_fault)
    placement = Placement(registry, roster, link.send, clock, cfg.workers.max_model_memory, cfg.workers.placement,
                          replay, on_failed=partial(answer_load_failure, batcher, door.fail),
                          on_resize=memory.forget)   # a load is no leak: judge afresh
    unserved = Unserved(batcher, roster, door.fail, placement.resident)   # answers for requests no worker will run
    tenants = Tenants(cfg.tenants, cfg.default_tenant, cfg.require_tenant, clock)
    sequences = Sequences(registry.models, clock)   # which sequence holds which worker and slot (sequence models)
    admission = Admission(server, cfg.workers, cfg.models, tenants, registry, batcher, stats, callers.owed, clock,
                          unserved.unavailable, shed=door.fail, workers=workers, demand=placement.demand,
                          drained=placement.drained, sequences=sequences)
    handshake = Handshake(registry, phase.is_serving, placement.forget_failed, placement.budget)
    # generations from their dispatch to their end: outputs out, cancels, slow readers, deaths
    streams = Streams(registry.models, clock, door.send_out, admission.finished, link.send, stats,
                      server.client_queue_bytes)
    serving = Serving(clock=clock, phase=phase, roster=roster, registry=registry, batcher=batcher, costs=costs,
                      admission=admission, placement=placement, unserved=unserved, handshake=handshake,
                      memory=memory, replay=replay, door=door, back=link, loop=loop,
                      max_inflight=server.max_inflight_batches_per_worker, streams=streams, enrols=not roster_given)

    # names served as DAGs of steps; shadow versions and guarded rollouts
    pipelines = Pipelines(PipelineDeps(models=registry.models, clock=clock, infer=door.infer, reply=door.reply,
                                       cancel_step=door.cancel_step, owed=callers.owed, tenants=tenants,
                                       is_open=admission.is_open, note=complaints.note), cfg.pipelines)
    shadows = Shadows(registry.models, serving.admit_copy, admission.copies.withdraw, clock)
    guards = Guards(shadows, clock)

    # polled jobs: their requests go back through the door with a caller of the wing's
    job_store = JobStore(cfg.jobs.max_jobs, cfg.jobs.max_result_bytes, cfg.jobs.keep_s, clock)
    jobs = Jobs(job_store, loop, cfg.jobs.max_wait_ms, door.reply, door.error, door.infer, door.drop_caller,
                door.admitted)

    # the front processes' end of the broker (none without front_processes): their socket, read
    # once the door is open (below), and their supervision, which status reads
    hub = FrontsHub(loop, fronts) if fronts is not None else None
    fleet = FrontFleet(fronts_count, cfg.server, cfg.supervisor, run_dir, hub, cfg.model_dump(mode="json"), clock) \
        if hub is not None else None

    # what the read-only answers read; then the operator (control ops, reloads), which reads it
    listening = Listening()
    reload_outcome: dict = {}   # the operator's reloader writes it
    view = BrokerView(clock=clock, started_at=phase.started_at, phase=phase.value, phases=tuple(p.value for p in Phase),
                      is_serving=phase.is_serving, roster=roster, models=registry.models, stats=stats, batcher=batcher,
                      costs=costs, complaints=complaints, callers=callers, max_request=admission.max_request,
                      limits=admission.limits, breakers=admission.breakers, tenants=tenants,
                      workers_of=placement.workers_of, events=placement.events, snapshots=memory.snapshots.latest,
                      reload=reload_outcome, listening=listening, abandoned=door.abandoned,
                      cancelled=door.cancelled, regions=door.regions_held, pipelines=pipelines,
                      faults=faults.as_dict, rollouts=guards.status, replay=replay.as_dict,
                      generators=streams.counters, sequences=sequences.counters,
                      jobs=job_store.as_dict, **({"fronts": fleet.as_dict} if fleet is not None else {}))
    metrics = Metrics(view)
    load = LoadReport(view, metrics.latencies)   # the faces attach its header; the lifecycle refreshes it
    operator = Operator(_operator_deps(cfg, registry, placement, admission, batcher, stats, pipelines, replay,
                                       unserved, shadows, guards, door, phase, view, clock, hub),
                        cfg, address, config_path, reload_outcome)
    answers = ReadOnlyAnswers(view, metrics.render)
    workers_side = WorkerMessages(serving, faults, stats)   # what workers send, by one table

    # the loops closed, once each: the door opens, the worker link listens, exits are heard
    door.open(DoorRoutes(roster=roster, models=registry.models, admit=admission.admit, finished=admission.finished,
                         leave=admission.leave, batcher=batcher, schedule=serving.schedule, flush=serving.flush,
                         query=answers.answer, operate=operator.handle, snapshot=serving.snapshot,
                         pipelines=pipelines, withdraw=serving.withdraw, answered=shadows.sample, streams=streams,
                         jobs=jobs, arrived=serving.arrived))
    link.listen(workers_side.on_message, after=serving.flush)
    if hub is not None:   # after the door: its answers and withdrawals exist
        hub.open(HubRoutes(infer=door.infer_drained, dispatch=door.dispatch, withdraw=door.abandon.drop_ids,
                           drop_caller=door.drop_caller, count_error=stats.error, note=complaints.note,
                           flush=serving.flush, regions=door.regions.handle), DirectoryBook(registry, pipelines, load, clock))
    admission.exits_to(*(hook for hook in (streams.exits, sequences.exits, guards.exits, metrics.finished, slow, tracer,
                                           door.abandon.finished)
                         if hook is not None))

    faces = _faces(cfg, DoorPort(token=token, view=view, entry=registry.entry, dispatch=door.dispatch,
                                 infer=door.infer, count_error=stats.error, note=complaints.note,
                                 withdraw=door.drop_caller, shm=TritonShm(server.max_region_bytes, roster),
                                 load=load, scrape=metrics.render,
                                 uploads=Uploads(cfg.model_roots[0]) if server.allow_model_uploads else None), operator)
    return Broker(clock=clock, phase=phase, roster=roster, complaints=complaints, callers=callers, registry=registry,
                  stats=stats, costs=costs, batcher=batcher, replay=replay, door=door, back=link, memory=memory,
                  faults=faults, placement=placement, admission=admission, handshake=handshake, pipelines=pipelines,
                  serving=serving, shadows=shadows, guards=guards, operator=operator, view=view, metrics=metrics,
                  load=load, workers_side=workers_side, listening=listening, faces=faces, tracer=tracer, hub=hub,
                  fronts=fleet)


def _operator_deps(cfg: Config, registry: Registry, placement: Placement, admission: Admission, batcher: Batcher,
                   stats: Stats, pipelines: Pipelines, replay: ReplayRecorder, unserved: Unserved,
                   shadows: Shadows, guards: Guards, door: FrontDoor, phase: BrokerPhase, view: BrokerView,
                   clock: Callable[[], float], hub: FrontsHub | None) -> OperatorDeps:
    def declare(m: ModelDecl) -> None:   # what assembly does for each configured model, and admission
        batcher.declare(m)
        stats.model(m.name)
        admission.declare(m)

    hooks = GuardHooks(check_policy=checked, shadow_of=shadows.shadow_of, guarded=guards.guarded,
                       start_shadow=shadows.start, watch=guards.watch, gone=guards.gone)
    rollout = RolloutDeps(registry=registry, placement=placement, clock=clock,
                          declare_breakers=admission.breakers.declare, forget_breakers=admission.breakers.forget,
                          unserved=unserved.versions, pipelines_blocking=pipelines.blocking,
                          pipeline_metadata=partial(pipelines.metadata, ready=partial(status.pipeline_ready, view)),
                          guards=hooks)
    reload = ReloadDeps(registry=registry, placement=placement, uptime=phase.uptime, declare=declare,
                        set_max_queue=batcher.set_max_queue, pipelines=pipelines.configure, warmup=replay.configure)
    reply = door.reply
    if hub is not None:   # a load, unload or reload done: the fronts hear of it before its caller does
        def reply(ident, msg, *frames) -> None:
            hub.look()
            door.reply(ident, msg, *frames)
    return OperatorDeps(rollout=rollout, reload=reload, reply=reply, serving=phase.is_serving, phase=phase.value)


def _faces(cfg: Config, port: DoorPort, operator: Operator) -> dict:
    """The faces configured by name ("http", "grpc", "torchserve"), not yet listening (run.py starts them)."""
    faces = {}
    torchserve = torchserve_face(cfg, port, operator)   # TorchServe's APIs: register and unregister are ops
    if torchserve is not None:
        faces["torchserve"] = torchserve
    if cfg.http is not None:   # the OpenAI face's routes share the HTTP face's port (/v1/...)
        openai = OpenAiFace(port, cfg.http.max_inflight)
        try:
            openai.check(openai.names())   # each tokenizer made, each chat template compiled, now
        except ValueError as exc:
            raise StartupError(f"openai face: {exc}") from None
        faces["http"] = HttpFace(port, cfg.http, mounts=openai.routes())
    if cfg.grpc is not None:   # imported only when configured: grpc is a large import
        from tgw.broker.faces.grpc.face import GrpcFace
        faces["grpc"] = GrpcFace(port, cfg.grpc, cfg.server.max_request_bytes, cfg.workers.output_bytes)
    return faces
