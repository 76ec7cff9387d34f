"""When a dead worker starts again, and when it is crash-looping (supervisor.crash_loop).

A worker that was serving when it died (an OOM kill under load, a hang the supervisor killed)
is not crash-looping: it is started again at once, and its death is not counted. Only a death
before ready, or within READY_GRACE_S of it, says the worker cannot get going; consecutive ones
back off exponentially (Kubernetes' CrashLoopBackOff: FIRST_DELAY_S, doubling, capped at
crash_loop.backoff_s), and crash_loop.deaths of them within crash_loop.window_s bench it: its
models are unavailable on it, and its next start waits crash_loop.backoff_s.

Pure bookkeeping, times passed in: nothing here waits or looks at a process.
"""
from __future__ import annotations

from collections import deque

from tgw.broker.config.load import CrashLoopDecl

FIRST_DELAY_S = 0.1
# a death this soon after ready counts as one before it: a worker that falls over as soon as it
# serves is crash-looping too. Short, so that a worker OOM-killed every few seconds under load
# (a start-up takes ~2 s on a CPU) is seen as serving in between
READY_GRACE_S = 1.0


def backoff_s(early_deaths: int, cap_s: float) -> float:
    """The delay before the next start after `early_deaths` consecutive deaths before ready
    (0: the last life was serving)."""
    return min(FIRST_DELAY_S * 2 ** max(early_deaths - 1, 0), cap_s)


class Restarts:
    def __init__(self, loop: CrashLoopDecl):
        self.loop = loop
        self._ready_at: dict[int, float] = {}   # worker id -> when its current life became ready
        self._early: dict[int, int] = {}        # worker id -> consecutive deaths before ready
        self._deaths: dict[int, deque] = {}     # worker id -> times of those deaths, in the window

    def spawned(self, worker_id: int) -> None:
        self._ready_at.pop(worker_id, None)

    def ready(self, worker_id: int, now: float) -> None:
        """Its current life serves (the first word of it wins: the handshake's, else a later look)."""
        self._ready_at.setdefault(worker_id, now)

    def died(self, worker_id: int, now: float) -> tuple[float, int]:
        """(seconds until its next start, deaths counted in the window when that benches it, else 0)."""
        ready = self._ready_at.pop(worker_id, None)
        deaths = self._deaths.setdefault(worker_id, deque())
        if ready is not None and now - ready >= READY_GRACE_S:   # it was serving: start again, count nothing
            self._early[worker_id] = 0
            deaths.clear()
            return FIRST_DELAY_S, 0
        early = self._early[worker_id] = self._early.get(worker_id, 0) + 1
        deaths.append(now)
        while deaths and deaths[0] < now - self.loop.window_s:
            deaths.popleft()
        if len(deaths) >= self.loop.deaths:
            return self.loop.backoff_s, len(deaths)
        return backoff_s(early, self.loop.backoff_s), 0

    def early_deaths(self, worker_id: int) -> int:
        return self._early.get(worker_id, 0)

    def forget(self, worker_id: int) -> None:
        for book in (self._ready_at, self._early, self._deaths):
            book.pop(worker_id, None)
