"""A shadow version's copies in the queues (canary/shadow.py): queued at the model's shadow level,
taken out when the shadow is promoted or goes, and their exits. None of a caller's accounting
(caps, tenants, limits, breakers, stats) sees them: their figures are their shadow's."""
from __future__ import annotations

from typing import Callable

from tgw.broker.state.pending import Pending, is_shadow
from tgw.broker.state.versions import VersionRecord

from .batcher import Batcher


class Copies:
    def __init__(self, batcher: Batcher, is_open: Callable[[], bool], drained: Callable[[VersionRecord], None]):
        self.batcher, self.is_open, self.drained = batcher, is_open, drained

    def admit(self, p: Pending) -> bool:
        """Queue a copy; False (dropped) while the broker stops or the queue is full: a copy never
        takes a caller's place."""
        q = self.batcher.queues.get(p.model)
        if not self.is_open() or q is None or q.count >= q.max_queue:
            return False
        self.batcher.push(p)
        p.record.admitted()
        return True

    def withdraw(self, model: str, version: str) -> None:
        """This shadow's queued copies out: none may share a batch with a caller's request once
        callers may name the version (promoted), nor wait for one that goes."""
        copies = self.batcher.take_where(lambda p: p.model == model and p.version == version and is_shadow(p.client))
        if copies:
            self.left(copies, "withdrawn")

    def left(self, ps: list[Pending], code: str | None) -> None:
        """Copies leave (admission.leave): answered (code None: their outputs went to their shadow
        through the front door) or not."""
        for p in ps:
            if p.record.left():
                self.drained(p.record)
            if code is not None:
                p.client.ended(p, code)
