"""Where the broker is in its life: one small part, built first, which the lifecycle alone moves
and everything else reads (readiness, control ops, the handshake, status)."""
from __future__ import annotations

from enum import Enum
from typing import Callable


class Phase(Enum):
    STARTING = "starting"    # workers loading; requests for versions not yet ready are refused
    SERVING = "serving"
    DRAINING = "draining"    # the drain notice (server.drain_notice_s): not ready, still serving everything
    STOPPING = "stopping"    # new requests refused; queued and in-flight ones finish


class BrokerPhase:
    def __init__(self, clock: Callable[[], float]):
        self.now = Phase.STARTING
        self.clock = clock
        self.started_at = clock()

    def uptime(self) -> float:
        """Seconds since the broker started, as status counts uptime_s."""
        return self.clock() - self.started_at

    def enter(self, phase: Phase) -> None:
        self.now = phase

    def is_serving(self) -> bool:
        """Taking and serving requests: also during the drain notice, which only health hides."""
        return self.now is Phase.SERVING or self.now is Phase.DRAINING

    def value(self) -> str:
        return self.now.value
