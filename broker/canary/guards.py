"""Guarded rollouts (docs/ROLLOUT.md): a canary or shadow version loaded with a policy is watched
on every look of the lifecycle (50 ms); the policy's verdict (policy.py) promotes it or rolls it
back through the operator, one op at a time like any other. Each decision is logged with the
numbers that made it, kept for `status`, and counted.

A canary is judged on its own callers' answers (admission's exits: errors, end-to-end latency)
against the serving versions' in the same window; a shadow on its copies (shadow.py).
"""
from __future__ import annotations

import logging
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Optional

from tgw.shm.wire import RolloutPolicy, as_builtins

from .policy import PROMOTE, WAIT, Observed, verdict
from .shadow import TIMES_KEPT, Shadows, ShadowWatch, p99_ms

log = logging.getLogger("tgw.broker")
DECISIONS_KEPT = 32


@dataclass
class Guard:
    model: str
    version: str
    kind: str                          # canary or shadow
    policy: RolloutPolicy
    started: float
    state: str = "watching"            # watching, promoting, rolling_back
    requests: int = 0                  # a canary's answered or failed requests
    errors: int = 0
    latency_s: deque = field(default_factory=lambda: deque(maxlen=TIMES_KEPT))      # a canary's
    serving_s: deque = field(default_factory=lambda: deque(maxlen=TIMES_KEPT))      # the others', same window
    seen: Observed = field(default_factory=Observed)


class Guards:
    def __init__(self, shadows: Shadows, clock: Callable[[], float]):
        self.shadows, self.clock = shadows, clock
        self.active: dict[str, Guard] = {}    # model -> its guard (one rollout at a time per model)
        self.decisions: deque[dict] = deque(maxlen=DECISIONS_KEPT)
        self.counts: Counter = Counter()      # (model, decision) -> decisions taken

    def watch(self, model: str, version: str, kind: str, policy: RolloutPolicy) -> None:
        self.active[model] = Guard(model, version, kind, policy, self.clock())

    def gone(self, model: str, versions: list[str] | None = None, why: str = "unloaded") -> None:
        """These versions (None: the whole model) left, or one was promoted: its guard is done,
        copies to it stop."""
        guard = self.active.get(model)
        if guard is not None and (versions is None or guard.version in versions):
            why = {"promoting": "promoted", "rolling_back": "rolled back"}.get(guard.state, why)
            del self.active[model]
        self.shadows.stop(model, versions, why)

    def exits(self, ps: list, code: Optional[str], now: float) -> None:
        """Admission's requests of one exit (one model and version): a guarded canary's count."""
        if not self.active:
            return
        first = ps[0]
        guard = self.active.get(first.model)   # (shadow copies never reach these hooks: sched/copies.py)
        if guard is None or guard.kind != "canary":
            return
        if first.version == guard.version:
            guard.requests += len(ps)
            if code is not None:
                guard.errors += len(ps)
            else:
                guard.latency_s.extend(now - p.arrived for p in ps)
        elif code is None:
            guard.serving_s.extend(now - p.arrived for p in ps)

    def check(self, now: float) -> list[tuple[str, str, str, str, dict]]:
        """The lifecycle's look: the verdicts reached now, each (promote or rollback, model,
        version, why, figures), for the operator to carry out."""
        verdicts = []
        for guard in list(self.active.values()):
            if guard.state != "watching":
                continue
            guard.seen = self._observe(guard, now)
            what, why = verdict(guard.policy, guard.seen)
            if what != WAIT:
                verdicts.append(self._decided(guard, what, why, now))
        return verdicts

    def _observe(self, g: Guard, now: float) -> Observed:
        seen = Observed(elapsed_s=now - g.started)
        if g.kind == "canary":
            seen.requests, seen.errors = g.requests, g.errors
            seen.p99_ms, seen.serving_p99_ms = p99_ms(g.latency_s, 1000), p99_ms(g.serving_s, 1000)
            return seen
        watch: ShadowWatch | None = self.shadows.active.get(g.model)
        if watch is None or watch.version != g.version:
            return seen
        failed = sum(watch.failures.values())
        summary = watch.summary()
        seen.requests, seen.errors = watch.compared_n + failed, failed
        seen.p99_ms, seen.serving_p99_ms = summary["compute_p99_ms"]["shadow"], summary["compute_p99_ms"]["serving"]
        for k, v in summary["worst"].items():
            setattr(seen, k, v)
        return seen

    def _decided(self, g: Guard, what: str, why: str, now: float) -> tuple[str, str, str, str, dict]:
        g.state = "promoting" if what == PROMOTE else "rolling_back"
        figures = g.seen.figures()
        record = {"model": g.model, "version": g.version, "kind": g.kind, "decision": what, "why": why,
                  "after_s": round(now - g.started, 3), "figures": figures}
        self.decisions.append(record)
        self.counts[(g.model, what)] += 1
        (log.info if what == PROMOTE else log.warning)(
            "rollout of %s:%s (%s): %s - %s", g.model, g.version, g.kind, what, why,
            extra={"event": "rollout_" + what, "model": g.model, "version": g.version, "figures": figures})
        return what, g.model, g.version, why, figures

    def guarded(self, model: str) -> Optional[str]:
        guard = self.active.get(model)
        return guard.version if guard is not None else None

    def status(self) -> dict:
        now = self.clock()
        shadows = [{**w.summary(), "for_s": round(now - w.started, 3)} for w in self.shadows.active.values()]
        watching = [{"model": g.model, "version": g.version, "kind": g.kind, "state": g.state,
                     "since_s": round(now - g.started, 3), "observed": g.seen.figures(),
                     "policy": {k: v for k, v in as_builtins(g.policy).items() if v is not None}}
                    for g in self.active.values()]
        return {"shadows": shadows, "ended_shadows": list(self.shadows.ended), "guarded": watching,
                "decisions": list(self.decisions),
                "decisions_total": [{"model": m, "decision": d, "n": n} for (m, d), n in sorted(self.counts.items())]}

