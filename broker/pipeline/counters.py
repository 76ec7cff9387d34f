"""What `status` and /metrics show of each pipeline: its requests and their outcomes, the runs
in flight, and per step the requests sent, their outcomes and latency. Written only by the
executor (executor.py, run.py)."""
from __future__ import annotations

from collections import Counter, deque

from tgw.broker.state.stats import Buckets

RECENT = 1024   # step latencies kept for the p99 `status` shows


class StepCounters:
    __slots__ = ("model", "sent", "ok", "failed", "seconds", "recent")

    def __init__(self, model: str):
        self.model = model
        self.sent = 0            # step requests handed to the front door
        self.ok = 0              # answered with outputs
        self.failed = 0          # answered with an error (refused by admission, or failed)
        self.seconds = Buckets()                    # from sent to answered, every answer (/metrics)
        self.recent: deque = deque(maxlen=RECENT)   # the same, the latest ones (status' p99)

    def answered(self, ok: bool, seconds: float) -> None:
        if ok:
            self.ok += 1
        else:
            self.failed += 1
        self.seconds.observe(seconds)
        self.recent.append(seconds)

    def as_dict(self) -> dict:
        recent = sorted(self.recent)
        p99 = recent[min(len(recent) - 1, int(len(recent) * 0.99))] if recent else 0.0
        mean = self.seconds.sum / self.seconds.count if self.seconds.count else 0.0
        return {"model": self.model, "sent": self.sent, "ok": self.ok, "failed": self.failed,
                "latency_ms": {"mean": round(mean * 1000, 3), "p99": round(p99 * 1000, 3)}}


class PipelineCounters:
    __slots__ = ("requests", "replies", "errors", "abandoned", "inflight", "steps")

    def __init__(self) -> None:
        self.requests = 0          # runs started (refusals at the entry are errors only)
        self.replies = 0           # answered with outputs
        self.errors: Counter = Counter()   # code -> answers with an error, refusals at the entry included
        self.abandoned = 0         # runs stopped: cancelled, or their caller went away
        self.inflight = 0          # runs started, not yet ended
        self.steps: dict[str, StepCounters] = {}

    def step(self, name: str, model: str) -> StepCounters:
        c = self.steps.get(name)
        if c is None or c.model != model:   # a reload may give a step another model: start afresh
            c = self.steps[name] = StepCounters(model)
        return c

    def as_dict(self) -> dict:
        return {"requests": self.requests, "replies": self.replies, "errors": dict(self.errors),
                "abandoned": self.abandoned, "inflight": self.inflight,
                "steps": {name: c.as_dict() for name, c in self.steps.items()}}
