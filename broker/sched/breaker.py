"""The circuit breaker of one model version - a pure class under an injected clock.

Closed, it counts what the workers answer over a sliding window (`window_s`, one-second slots)
and opens on any of three trips: the failed share of at least `min_requests` answers reaches
`error_rate`; the p99 of compute latency (dispatch to answer: queueing is the concurrency
limit's business) exceeds `p99_factor` x slo_p99_ms; or a worker serving it reports memory over
`memory_fraction` (RSS against host memory on CPU, device memory on GPU). Open, it admits
nothing for `cooldown_s`: admission routes to the fallback or answers CIRCUIT_OPEN with
retry_after_ms. Then half-open: `probes` requests go through; all succeeding closes it, any
failure (or a trip) opens it again. Every transition is logged and kept for stats.
"""
from __future__ import annotations

import logging
import math
from collections import deque
from enum import Enum

from tgw.shm.errors import Code
from tgw.shm.wire import split_model_key

from .pressure import memory_fraction
from tgw.broker.config.schema import BreakerDecl

log = logging.getLogger("tgw.broker.sched.breaker")

# answers that count against the model, not the caller or the load
FAILURES = frozenset({Code.MODEL_EXECUTION_ERROR.value, Code.WORKER_DIED.value, Code.OUT_OF_GPU_MEMORY.value,
                      Code.INTERNAL.value})
LAT_BUCKETS = 1.1  # latency histogram buckets grow by 10 %: p99 to within 10 %
HISTORY = 20       # transitions kept for stats


class State(str, Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class _Slot:
    __slots__ = ("second", "n", "failed", "lat")

    def __init__(self, second: int):
        self.second, self.n, self.failed = second, 0, 0
        self.lat: dict[int, int] = {}   # log-bucket -> count


def _bucket(seconds: float) -> int:
    return int(math.log(max(seconds, 1e-6) * 1e6, LAT_BUCKETS))


class Breaker:
    def __init__(self, name: str, decl: BreakerDecl, slo_s: float | None, now: float = 0.0):
        self.name, self.decl = name, decl
        self.p99_limit = decl.p99_factor * slo_s if decl.p99_factor and slo_s else None
        self.state = State.CLOSED
        self.since = now
        self.reason = ""
        self.slots: deque[_Slot] = deque()
        self.probes_admitted = self.probes_ok = 0
        self.history: deque[dict] = deque(maxlen=HISTORY)
        self.rejected = 0

    # ---- admission ---------------------------------------------------------------------------

    def allow(self, now: float) -> bool:
        """Whether a request may go to this version now (a half-open probe counts as allowed)."""
        if self.state is State.OPEN:
            if now - self.since < self.decl.cooldown_s:
                self.rejected += 1
                return False
            self._move(State.HALF_OPEN, now, "cooldown over: probing")
        if self.state is State.HALF_OPEN:
            if self.probes_admitted >= self.decl.probes:
                if now - self.since < self.decl.cooldown_s:
                    self.rejected += 1
                    return False
                # the probes never came back (expired in the queue, say): probe again
                self.since, self.probes_admitted, self.probes_ok = now, 0, 0
            self.probes_admitted += 1
        return True

    def retry_after_s(self, now: float) -> float:
        """Until the breaker will let a probe through (0 while it would now)."""
        if self.state is State.OPEN:
            return max(0.0, self.since + self.decl.cooldown_s - now)
        return 0.0

    # ---- what the workers answered -----------------------------------------------------------

    def record(self, failed: bool, latency_s: float, now: float) -> None:
        if self.state is State.OPEN:
            return  # answers to requests admitted before it opened say nothing new
        if self.state is State.HALF_OPEN:
            if failed:
                self._move(State.OPEN, now, "a half-open probe failed")
            else:
                self.probes_ok += 1
                if self.probes_ok >= self.decl.probes:
                    self._move(State.CLOSED, now, f"{self.probes_ok} probes succeeded")
            return
        slot = self._slot(now)
        slot.n += 1
        slot.failed += failed
        b = _bucket(latency_s)
        slot.lat[b] = slot.lat.get(b, 0) + 1
        if failed:
            n, bad = self._totals()
            if n >= self.decl.min_requests and bad >= self.decl.error_rate * n:
                self._move(State.OPEN, now, f"error rate {bad}/{n} >= {self.decl.error_rate:g} "
                                            f"over {self.decl.window_s:g}s")

    def check(self, now: float) -> None:
        """Periodic: the latency trip (cheaper here than per answer) and window upkeep."""
        self._trim(now)
        if self.state is not State.CLOSED or self.p99_limit is None:
            return
        n, _ = self._totals()
        if n < self.decl.min_requests:
            return
        p99 = self._p99(n)
        if p99 > self.p99_limit:
            self._move(State.OPEN, now, f"compute p99 {p99 * 1000:.1f} ms > {self.decl.p99_factor:g} x slo "
                                        f"({self.p99_limit * 1000:.1f} ms)")

    def memory(self, fraction: float, where: str, now: float) -> None:
        """A serving worker's memory share, from its heartbeat."""
        limit = self.decl.memory_fraction
        if limit is not None and fraction > limit and self.state is not State.OPEN:
            self._move(State.OPEN, now, f"{where} memory at {fraction:.1%} > memory_fraction {limit:.1%}")

    # ---- internals ---------------------------------------------------------------------------

    def _move(self, to: State, now: float, reason: str) -> None:
        log.warning("circuit breaker %s: %s -> %s (%s)", self.name, self.state.value, to.value, reason,
                    extra={"event": "breaker", "breaker": self.name, "from": self.state.value, "to": to.value,
                           "reason": reason})
        self.history.append({"at": round(now, 3), "from": self.state.value, "to": to.value, "reason": reason})
        self.state, self.since, self.reason = to, now, reason
        self.probes_admitted = self.probes_ok = 0
        if to is not State.HALF_OPEN:
            self.slots.clear()  # a fresh window: old failures must not reopen a closed breaker

    def _slot(self, now: float) -> _Slot:
        second = int(now)
        if not self.slots or self.slots[-1].second != second:
            self.slots.append(_Slot(second))
            self._trim(now)
        return self.slots[-1]

    def _trim(self, now: float) -> None:
        oldest = now - self.decl.window_s
        while self.slots and self.slots[0].second + 1 <= oldest:
            self.slots.popleft()

    def _totals(self) -> tuple[int, int]:
        return sum(s.n for s in self.slots), sum(s.failed for s in self.slots)

    def _p99(self, n: int) -> float:
        merged: dict[int, int] = {}
        for s in self.slots:
            for b, c in s.lat.items():
                merged[b] = merged.get(b, 0) + c
        rank, seen = math.ceil(0.99 * n), 0
        for b in sorted(merged):
            seen += merged[b]
            if seen >= rank:
                return LAT_BUCKETS ** (b + 1) / 1e6  # the bucket's upper edge
        return 0.0

    def as_dict(self, now: float) -> dict:
        n, bad = self._totals()
        return {"state": self.state.value, "since_s": round(now - self.since, 3), "reason": self.reason,
                "window_requests": n, "window_failed": bad, "rejected": self.rejected,
                "retry_after_ms": math.ceil(self.retry_after_s(now) * 1000), "transitions": list(self.history)}


class Breakers:
    """The breakers of every configured model version, and each model's fallback."""

    def __init__(self, models: list, now: float = 0.0):
        self.by_key: dict[tuple[str, str], Breaker] = {}
        self.fallback: dict[str, str] = {}
        for m in models:
            self.declare(m, [v.version for v in m.versions], now)

    def declare(self, m, versions: list[str], now: float) -> None:
        """Breakers for these versions of model `m` (a version loaded at run time gets one too)."""
        if m.breaker is None:
            return
        slo = m.slo_p99_ms / 1000 if m.slo_p99_ms else None
        for v in versions:
            if (m.name, v) not in self.by_key:
                self.by_key[(m.name, v)] = Breaker(f"{m.name}:{v}", m.breaker, slo, now)
        if m.breaker.fallback:
            self.fallback[m.name] = m.breaker.fallback

    def forget(self, model: str, version: str) -> None:
        self.by_key.pop((model, version), None)

    def get(self, model: str, version: str) -> Breaker | None:
        return self.by_key.get((model, version))

    def check(self, now: float) -> None:
        for b in self.by_key.values():
            b.check(now)

    def on_beat(self, worker, beat, now: float) -> None:
        """A worker's heartbeat: the memory trip of the breakers of the versions it serves."""
        mine = [b for key in worker.models if (b := self.by_key.get(split_model_key(key))) is not None
                and b.decl.memory_fraction is not None]
        if mine:
            fraction = memory_fraction(worker.device, beat, worker.device_memory)
            for b in mine:
                b.memory(fraction, worker.name, now)

    def as_dict(self, model: str, now: float) -> dict:
        return {v: b.as_dict(now) for (m, v), b in self.by_key.items() if m == model}
