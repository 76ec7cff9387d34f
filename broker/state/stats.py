"""Per-model counters the broker keeps for `stats` and /metrics (broker/observe/metrics.py)."""
from __future__ import annotations

import time
from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable

# upper bounds (seconds) of the latency histograms: per request end to end and queued, per batch computing
SECONDS = (0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class Buckets:
    """A histogram's counts under fixed upper bounds, as Prometheus keeps them (`le`: a value
    equal to a bound counts in that bound's bucket); the last count is above every bound.
    observe() is one bisect and two additions: cheap enough for every request."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Iterable[float] = SECONDS):
        self.bounds = tuple(bounds)
        if list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError(f"bucket bounds must be strictly increasing: {self.bounds}")
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += n
        self.sum += value * n

    def observe_each(self, values: list[float]) -> None:
        counts, bounds = self.counts, self.bounds
        for value in values:
            counts[bisect_left(bounds, value)] += 1
        self.sum += sum(values)

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations at or below it) per bucket, ending with (inf, count)."""
        out, seen = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts):
            seen += n
            out.append((bound, seen))
        return out


class Timed:
    """A count and the nanoseconds they took together (Triton's {count, ns})."""
    __slots__ = ("count", "ns")

    def __init__(self) -> None:
        self.count, self.ns = 0, 0

    def add(self, ns: int, n: int = 1) -> None:
        self.count += n
        self.ns += ns


class VersionCounters:
    """One version's requests and batches, as Triton's statistics extension reports them
    (broker/protocol/triton_docs.py builds the document)."""
    __slots__ = ("success", "fail", "queue", "compute", "inferences", "executions", "last_inference_ms",
                 "batch_compute")

    def __init__(self) -> None:
        self.success = Timed()       # answered with outputs: admission to answer
        self.fail = Timed()          # admitted, answered with an error
        self.queue = Timed()         # the answered ones: admission to dispatch
        self.compute = Timed()       # the answered ones: their batch's compute time
        self.inferences = 0          # rows answered
        self.executions = 0          # batches computed
        self.last_inference_ms = 0   # wall clock (ms since the epoch) of the last request's end
        self.batch_compute: dict[int, Timed] = {}   # rows per batch -> those batches' compute


@dataclass
class ModelCounters:
    requests: int = 0          # admitted
    replies: int = 0           # answered with outputs
    batches: int = 0
    rows: int = 0
    errors: Counter = field(default_factory=Counter)        # code -> n: every error answered naming the model
    batch_sizes: Counter = field(default_factory=Counter)   # rows per batch -> n
    compute_us: int = 0
    compute: Buckets = field(default_factory=Buckets)       # seconds per batch, for /metrics
    shed: Counter = field(default_factory=Counter)          # priority -> refused or shed with OVERLOADED
    fallbacks: int = 0                                      # routed to the breaker's fallback model
    versions: dict = field(default_factory=dict)            # version -> VersionCounters

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
        """Every error reply: refusals before admission and admitted requests' failures alike
        (metrics.py tells them apart by what its on_finished hook saw)."""
        if model is not None and model in self.models:
            self.models[model].errors[code] += 1
        else:
            self.unrouted_errors[code] += 1

    def version(self, model: str, version: str) -> VersionCounters:
        c = self.models.get(model)   # per request (finished): one call, not two, when both exist
        versions = (c if c is not None else self.model(model)).versions
        v = versions.get(version)
        if v is None:
            v = versions[version] = VersionCounters()
        return v

    def batch(self, model: str, rows: int, compute_us: int, version: str | None = None) -> None:
        c = self.model(model)
        c.batches += 1
        c.rows += rows
        c.batch_sizes[rows] += 1
        c.compute_us += compute_us
        c.compute.observe(compute_us / 1e6)
        if version is not None:
            v = self.version(model, version)
            v.executions += 1
            timed = v.batch_compute.get(rows)
            if timed is None:
                timed = v.batch_compute[rows] = Timed()
            timed.add(compute_us * 1000)

    def left(self, model: str, version: str, ps: list, ok: bool, now: float) -> None:
        """Admitted requests of one version leave (admission's `leave`): answered with outputs
        (`ok`) or an error. Clock seconds; a request's `dispatched` None: never handed to a worker."""
        v = self.version(model, version)
        v.last_inference_ms = time.time_ns() // 1_000_000
        n, total_ns = len(ps), 0
        if not ok:
            for p in ps:
                total_ns += int((now - p.arrived) * 1e9)
            v.fail.add(total_ns, n)
            return
        queue_ns = compute_us = rows = 0
        for p in ps:
            total_ns += int((now - p.arrived) * 1e9)
            if p.dispatched is not None:
                queue_ns += int((p.dispatched - p.arrived) * 1e9)
            compute_us += p.compute_us
            rows += p.rows
        v.success.add(total_ns, n)
        v.queue.add(queue_ns, n)
        v.compute.add(compute_us * 1000, n)
        v.inferences += rows
