"""The broker's load report: what a load-aware balancer routes by - ORCA's `endpoint-load-metrics`
(text form) on every HTTP response and in every gRPC inference call's trailing metadata - and
its JSON twin, `GET /v2/load`.

The figures (docs/OPERATIONS.md#health-readiness-and-load says what each means to a balancer):
* cpu_utilization: CPU seconds the broker and its workers spend per second, over the CPUs the
  broker may run on (its affinity); a worker's from its last two heartbeats.
* mem_utilization: the host's memory in use (1 - available / total).
* application_utilization: the workers' busy share over the window: batch compute time over
  wall time x live workers (1 while no worker is live: no capacity).
* rps_fractional: requests answered (outputs or errors) per second over the window.
* named_metrics.queue_depth: requests queued now, all models; .inflight: admitted and not yet
  answered (queued or computing).
* named_metrics.p99_over_slo: the worst model's p99 end-to-end latency over the window (from
  the /metrics histogram, interpolated in its bucket as Prometheus' histogram_quantile does)
  over its SLO: the model's slo_p99_ms, else its timeout_ms; 0 without answers in the window.
* named_metrics.memory_headroom: the free share of the live workers' arenas (input and output),
  or of GPU memory where workers run on GPUs, whichever is smaller.

Computed by `refresh`, at most every REFRESH_S, on the lifecycle's periodic look - never per
response: a response attaches `header`, a string made once per refresh.
"""
from __future__ import annotations

import os
import time
from collections import deque
from typing import Callable, NamedTuple

import psutil

from tgw.broker.state.pool import WorkerState
from tgw.broker.state.stats import SECONDS

from .status import BrokerView

HEADER = "endpoint-load-metrics"
WINDOW_S = 2.0       # utilisation, rate and p99 over about this much of the recent past
REFRESH_S = 0.1      # figures at most this old
TOP = ("cpu_utilization", "mem_utilization", "application_utilization", "rps_fractional")
NAMED = ("queue_depth", "inflight", "p99_over_slo", "memory_headroom")
DRAINING = "draining"   # the phase of the drain notice (core/phase.py's Phase.DRAINING)


class Sample(NamedTuple):
    """The running totals at one refresh; a window's figures are two samples' differences."""
    at: float
    compute_us: int             # batch compute, all models
    answered: int               # requests answered, all models
    broker_cpu_s: float         # this process's CPU time
    e2e: dict                   # model -> its end-to-end histogram's bucket counts


class LoadReport:
    def __init__(self, view: BrokerView, latencies: Callable[[], dict], cpus: int | None = None):
        """`latencies`: model -> its end-to-end seconds histogram (Metrics.latencies)."""
        self.view, self.latencies = view, latencies
        self.cpus = cpus or len(os.sched_getaffinity(0))
        self.samples: deque[Sample] = deque()
        self.beats: dict[int, tuple[int, float, float, float]] = {}   # worker id -> (pid, sent, cpu_s, rate)
        self.at = float("-inf")
        self.draining = False   # the drain notice: the HTTP face closes connections after each response
        self.doc: dict = {**{k: 0.0 for k in TOP}, "named_metrics": {k: 0 for k in NAMED}}
        self.header = text(self.doc)

    def refresh(self, now: float, force: bool = False) -> None:
        """New figures, header and document, unless the last ones are under REFRESH_S old."""
        if now - self.at < REFRESH_S and not force:
            return
        self.at = now
        view = self.view
        counters = view.stats.models.values()
        new = Sample(now, sum(c.compute_us for c in counters),
                     sum(c.replies + sum(c.errors.values()) for c in counters), time.process_time(),
                     {m: tuple(h.counts) for m, h in self.latencies().items()})
        samples = self.samples
        samples.append(new)
        while len(samples) > 2 and now - samples[1].at >= WINDOW_S:
            samples.popleft()
        old = samples[0]
        span = now - old.at
        live = [w for w in view.roster if w.state is WorkerState.READY]
        if not live:
            busy = 1.0
        else:
            busy = (new.compute_us - old.compute_us) / 1e6 / (span * len(live)) if span > 0 else 0.0
        models = self.model_figures(old, new)
        inflight = sum(r.active for m in view.models.values() for r in m.records.values())
        self.doc = {
            "cpu_utilization": figure(self.cpu(live, old, new, span)),
            "mem_utilization": figure(memory_used()),
            "application_utilization": figure(busy),
            "rps_fractional": figure((new.answered - old.answered) / span if span > 0 else 0.0),
            "named_metrics": {"queue_depth": view.batcher.queued(), "inflight": inflight,
                              "p99_over_slo": figure(max((m["p99_over_slo"] for m in models.values()), default=0.0)),
                              "memory_headroom": figure(headroom(live))},
            "phase": view.phase(), "window_s": round(span, 3), "models": models}
        self.header = text(self.doc)
        self.draining = self.doc["phase"] == DRAINING

    def cpu(self, live: list, old: Sample, new: Sample, span: float) -> float:
        """The broker's CPU rate over the window plus each live worker's over its last two beats,
        over the CPUs this broker may use."""
        rate = (new.broker_cpu_s - old.broker_cpu_s) / span if span > 0 else 0.0
        seen = {}
        for w in live:
            beat = w.beat
            if beat is None:
                continue
            last = self.beats.get(w.worker_id)
            if last is None or last[0] != w.pid:     # a new life: its first beat sets the baseline
                seen[w.worker_id] = (w.pid, beat.sent, beat.cpu_s, 0.0)
            elif beat.sent > last[1]:
                seen[w.worker_id] = (w.pid, beat.sent, beat.cpu_s, max(0.0, (beat.cpu_s - last[2]) / (beat.sent - last[1])))
            else:
                seen[w.worker_id] = last
            rate += seen[w.worker_id][3]
        self.beats = seen
        return rate / self.cpus

    def model_figures(self, old: Sample, new: Sample) -> dict:
        """Per model: queued, in flight, the window's p99 (ms; None without answers) and its SLO."""
        view, out = self.view, {}
        for name, entry in view.models.items():
            if entry.removed:
                continue
            decl = entry.decl
            slo_key = "slo_p99_ms" if decl.slo_p99_ms else "timeout_ms"
            slo_ms = float(getattr(decl, slo_key))
            counts = new.e2e.get(name)
            before = old.e2e.get(name)
            delta = [a - b for a, b in zip(counts, before)] if counts and before else list(counts or ())
            p99 = quantile(delta, 0.99) if delta and sum(delta) else None
            out[name] = {"queued": view.batcher.queued(name) if name in view.batcher.queues else 0,
                         "inflight": sum(r.active for r in entry.records.values()),
                         "p99_ms": round(p99 * 1000, 3) if p99 is not None else None,
                         "slo_ms": slo_ms, "slo_key": slo_key,
                         "p99_over_slo": figure(p99 * 1000 / slo_ms) if p99 is not None else 0.0}
        return out


def quantile(counts: list[int], q: float, bounds: tuple = SECONDS) -> float:
    """The q-quantile of a histogram's bucket counts (the last bucket: above every bound),
    linear within its bucket; the largest bound when it falls in the last one."""
    rank, seen = q * sum(counts), 0
    for i, n in enumerate(counts):
        if n and seen + n >= rank:
            if i >= len(bounds):
                return bounds[-1]
            low = bounds[i - 1] if i else 0.0
            return low + (bounds[i] - low) * (rank - seen) / n
        seen += n
    return bounds[-1]


def headroom(live: list) -> float:
    """The free share of the live workers' arenas; of their GPUs' memory where that is smaller."""
    total = free = 0
    gpus: dict[str, tuple[int, int]] = {}
    for w in live:
        out_used = w.beat.output_used if w.beat is not None else 0
        total += w.inputs.capacity + w.output_bytes
        free += (w.inputs.capacity - w.inputs.in_use) + max(0, w.output_bytes - out_used)
        gpu = w.beat.gpu if w.beat is not None else None
        if gpu is not None and gpu.memory_total and gpu.memory_used is not None:
            gpus[w.device_uuid or w.device] = (gpu.memory_used, gpu.memory_total)   # one entry per device
    share = free / total if total else 0.0
    if gpus:
        share = min(share, 1.0 - sum(u for u, _ in gpus.values()) / sum(t for _, t in gpus.values()))
    return max(0.0, share)


def memory_used() -> float:
    mem = psutil.virtual_memory()
    return 1.0 - mem.available / mem.total if mem.total else 0.0


def figure(x: float) -> float:
    """Four decimals: plenty for routing, and short in a header; never negative (ORCA refuses it)."""
    return round(max(0.0, x), 4)


def text(doc: dict) -> str:
    """ORCA's text form: `TEXT key=value, ...`, the named metrics as `named_metrics.<name>`."""
    named = doc["named_metrics"]
    return "TEXT " + ", ".join([f"{k}={doc[k]}" for k in TOP] + [f"named_metrics.{k}={named[k]}" for k in NAMED])


def parse(value: str) -> dict:
    """A header in ORCA's text form back to {key: float} (named metrics keep their prefix), as
    Envoy reads it: refused if it is not TEXT, a pair lacks a value, a key repeats, a value is
    not a finite number >= 0. For tests and tools (`tgw-bench fleet` reads the brokers' load)."""
    if not value.startswith("TEXT "):
        raise ValueError(f"not ORCA's text form (no 'TEXT ' prefix): {value!r}")
    out: dict[str, float] = {}
    for pair in value[5:].split(","):
        key, sep, number = pair.strip().partition("=")
        if not sep or not key or not number:
            raise ValueError(f"not key=value: {pair!r}")
        if key in out:
            raise ValueError(f"duplicate metric {key!r}")
        if key not in TOP and not (key.startswith("named_metrics.") and len(key) > len("named_metrics.")):
            raise ValueError(f"unsupported metric name {key!r}")
        x = float(number)
        if not (0.0 <= x < float("inf")):
            raise ValueError(f"{key}: {number!r} is not a finite number >= 0")
        out[key] = x
    return out
