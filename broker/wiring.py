"""The narrow records the core hands each wing: built here from the Broker, so no wing sees it.

Each wing declares the record of what it reads and calls (front.frontdoor.DoorDeps, ...); the
functions here fill them in (`b`: the server.Broker; not imported, as server imports this). Attributes the core may replace later (the operator, the HTTP
face) are read through lambdas, at call time.
"""
from __future__ import annotations

from tgw.broker.front.frontdoor import DoorDeps
from tgw.broker.observe import status


def door_deps(b) -> DoorDeps:
    a = b.admission
    return DoorDeps(server=b.server, token=b.token, clock=b.clock, complaints=b.complaints, callers=b.callers,
                    stats=b.stats, roster=b.roster, models=b.registry.models, admit=a.admit, finished=a.finished,
                    on_finished=a.on_finished, batcher=b.batcher, schedule=b.schedule, flush=b.flush,
                    query=lambda msg: status.ANSWERS[type(msg)](b, msg.id), operate=b.operate,
                    snapshot=lambda msg, answer: b.memory.request(b.roster, msg, b.clock(), answer))
