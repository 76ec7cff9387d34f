"""Per-model counters the broker keeps for `stats` (and, later, /metrics)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class ModelCounters:
    requests: int = 0          # admitted
    replies: int = 0           # answered with outputs
    batches: int = 0
    rows: int = 0
    errors: Counter = field(default_factory=Counter)        # code -> n
    batch_sizes: Counter = field(default_factory=Counter)   # rows per batch -> n
    compute_us: int = 0
    shed: Counter = field(default_factory=Counter)          # priority -> refused or shed with OVERLOADED
    fallbacks: int = 0                                      # routed to the breaker's fallback model

    def as_dict(self) -> dict:
        return {"requests": self.requests, "replies": self.replies, "batches": self.batches, "rows": self.rows,
                "errors": dict(self.errors), "batch_sizes": {str(k): v for k, v in sorted(self.batch_sizes.items())},
                "compute_us": self.compute_us, "shed": {str(k): v for k, v in sorted(self.shed.items())},
                "fallbacks": self.fallbacks}


class Stats:
    def __init__(self) -> None:
        self.models: dict[str, ModelCounters] = {}
        self.unrouted_errors: Counter = Counter()  # errors before a model was known

    def model(self, name: str) -> ModelCounters:
        c = self.models.get(name)
        if c is None:
            c = self.models[name] = ModelCounters()
        return c

    def error(self, model: str | None, code: str) -> None:
        if model is not None and model in self.models:
            self.models[model].errors[code] += 1
        else:
            self.unrouted_errors[code] += 1

    def batch(self, model: str, rows: int, compute_us: int) -> None:
        c = self.model(model)
        c.batches += 1
        c.rows += rows
        c.batch_sizes[rows] += 1
        c.compute_us += compute_us
