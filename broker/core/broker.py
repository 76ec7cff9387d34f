"""The assembled broker: every part, held once, as the assembly built them (assembly.py).

It holds its parts and moves between phases; the serving itself (queues to workers, deaths)
is serving.py's, the process's life (start, watch, drain) lifecycle.py's. Nothing sets a part
on it from outside: it is frozen.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from tgw.broker.canary.guards import Guards
from tgw.broker.canary.shadow import Shadows
from tgw.broker.fleet.faults import CudaFaults
from tgw.broker.fleet.handshake import Handshake
from tgw.broker.fleet.memory import MemoryWatch
from tgw.broker.front.callers import Callers
from tgw.broker.front.frontdoor import FrontDoor
from tgw.broker.models.operator import Operator
from tgw.broker.models.placement import Placement
from tgw.broker.models.registry import Registry
from tgw.broker.models.replay import ReplayRecorder
from tgw.broker.observe.load import LoadReport
from tgw.broker.observe.metrics import Metrics
from tgw.broker.observe.status import BrokerView, Listening
from tgw.broker.pipeline.executor import Pipelines
from tgw.broker.sched.admission import Admission
from tgw.broker.sched.batcher import Batcher
from tgw.broker.sched.costmodel import CostModel
from tgw.broker.state.complaints import Complaints
from tgw.broker.state.stats import Stats

from .phase import BrokerPhase, Phase
from .serving import Serving, WorkerLink, WorkerMessages


@dataclass(frozen=True)
class Broker:
    clock: Callable[[], float]
    phase: BrokerPhase
    roster: list                 # every worker, in any state: the supervisor's list, which it alone changes
    complaints: Complaints
    callers: Callers
    registry: Registry
    stats: Stats
    costs: CostModel
    batcher: Batcher
    replay: ReplayRecorder
    door: FrontDoor
    back: WorkerLink
    memory: MemoryWatch
    faults: CudaFaults
    placement: Placement
    admission: Admission
    handshake: Handshake
    pipelines: Pipelines
    serving: Serving
    shadows: Shadows
    guards: Guards
    operator: Operator
    view: BrokerView
    metrics: Metrics
    load: LoadReport
    workers_side: WorkerMessages
    listening: Listening
    faces: dict                  # the faces configured by name ("http", "grpc"), each with start() and stop()
    tracer: Any = None           # observe/tracing.Tracer when tracing is on
    hub: Any = None              # fronts/hub.FrontsHub with front processes (server.front_processes)
    fronts: Any = None           # fronts/fleet.FrontFleet: their supervision, the same

    def tick(self, now: float) -> None:
        """The lifecycle's periodic look: the serving core's, then the guards' verdicts, which
        the operator carries out."""
        self.serving.tick(now)
        for verdict in self.guards.check(now):
            self.operator.decide(*verdict)

    def start_serving(self) -> None:
        self.phase.enter(Phase.SERVING)

    def announce_stop(self) -> None:
        """The drain notice: health says not ready, everything else goes on serving."""
        self.phase.enter(Phase.DRAINING)

    def begin_stop(self) -> None:
        self.phase.enter(Phase.STOPPING)
        self.admission.close()

    def close(self) -> None:
        self.serving.close()
        if self.hub is not None:
            self.hub.close()
