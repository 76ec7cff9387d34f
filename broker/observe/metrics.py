"""Prometheus metrics of the broker: what `GET /metrics` and `tgw-broker metrics` serve.

The hot path pays for plain counters only: one hook per request as it leaves (admission's
on_finished: its outcome by version, its end-to-end and queued seconds into fixed buckets) and
a bucket per batch (stats.Stats.batch). Everything else is read from the state the broker
already owns when a scrape comes, by a custom collector on a registry of this broker's own (a
test process may hold several brokers). The table in docs/OPERATIONS.md (Metrics) lists every
family; metrics_state.py has the workers', versions' and scheduler's, metrics_gpu.py the GPU
workers' device figures (NVML, as their heartbeats carry them).
"""
from __future__ import annotations

from collections import Counter
from typing import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from tgw.broker.state.pending import Pending
from tgw.broker.state.stats import Buckets

from . import metrics_gpu, metrics_rollout, metrics_state
from .status import BrokerView

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)   # upper bounds of the batch-size histogram
OK = "OK"                                               # the code label of a request answered with outputs


class ModelSeries:
    """What the on_finished hook keeps for one model."""
    __slots__ = ("outcomes", "e2e", "queue")

    def __init__(self) -> None:
        self.outcomes: Counter = Counter()   # (version, code; None: answered with outputs) -> requests
        self.e2e = Buckets()      # seconds from admission to the answer, requests answered with outputs
        self.queue = Buckets()    # seconds from admission to the dispatch of their batch, the same requests


def histogram(fam: HistogramMetricFamily, labels: list[str], buckets: Buckets) -> None:
    fam.add_metric(labels, [(floatToGoString(le), n) for le, n in buckets.cumulative()], buckets.sum)


class Metrics(Collector):
    def __init__(self, view: BrokerView):
        """`finished` is admission's hook on each request's end: it counts outcomes."""
        self.view = view
        self.series: dict[str, ModelSeries] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def finished(self, ps: list[Pending], code: str | None, now: float) -> None:
        """Admitted requests of one model and version leave (code None: answered with outputs) -
        on the hot path: once per batch answered."""
        first = ps[0]
        s = self.series.get(first.model)
        if s is None:
            s = self.series[first.model] = ModelSeries()
        s.outcomes[first.version, code] += len(ps)
        if code is None:
            s.e2e.observe_each([now - p.arrived for p in ps])
            s.queue.observe_each([p.dispatched - p.arrived for p in ps if p.dispatched])

    def latencies(self) -> dict:
        """model -> its end-to-end seconds histogram (the load report's)."""
        return {m: s.e2e for m, s in self.series.items()}

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def collect(self) -> Iterator:
        view = self.view
        now = view.clock()
        yield self._requests()
        yield from self._latency()
        yield from self._queues()
        yield from metrics_state.broker_families(view, now)
        yield from metrics_state.worker_families(view, now)
        yield from metrics_state.version_families(view, now)
        yield from metrics_state.scheduler_families(view)
        yield from metrics_state.pipeline_families(view)
        yield from metrics_state.cache_families(view)
        yield from metrics_gpu.families(view.roster)
        yield from metrics_gpu.device_families(view)
        yield from metrics_rollout.families(view)

    def _requests(self) -> CounterMetricFamily:
        """Every answer to an infer: admitted ones by version and code, as the hook counted them;
        refusals before admission (no version yet: "") are the errors the stats counted for the
        model beyond those; errors naming no declared model have model "" too."""
        fam = CounterMetricFamily("tgw_requests", "Inference requests answered, by model, version and outcome "
                                  "code (OK: answered with outputs)", labels=["model", "version", "code"])
        stats = self.view.stats
        for model in {**stats.models, **self.series}:
            admitted_errors: Counter = Counter()
            s = self.series.get(model)
            for (version, code), n in (s.outcomes.items() if s else ()):
                fam.add_metric([model, version, code or OK], n)
                if code is not None:
                    admitted_errors[code] += n
            c = stats.models.get(model)
            for code, n in (c.errors.items() if c else ()):
                if n > admitted_errors[code]:
                    fam.add_metric([model, "", code], n - admitted_errors[code])
        for code, n in stats.unrouted_errors.items():
            fam.add_metric(["", "", code], n)
        return fam

    def _latency(self) -> Iterator:
        e2e = HistogramMetricFamily("tgw_request_duration_seconds", "Seconds from admission to the answer, of "
                                    "requests answered with outputs", labels=["model"])
        queued = HistogramMetricFamily("tgw_request_queue_seconds", "Seconds from admission until the request's "
                                       "batch went to a worker, of requests answered with outputs", labels=["model"])
        for model, s in self.series.items():
            histogram(e2e, [model], s.e2e)
            histogram(queued, [model], s.queue)
        compute = HistogramMetricFamily("tgw_batch_compute_seconds", "Worker seconds per batch (forward and output "
                                        "copy), of batches completed without error", labels=["model"])
        rows = HistogramMetricFamily("tgw_batch_size_rows", "Rows per batch, of batches completed without error",
                                     labels=["model"])
        for model, c in self.view.stats.models.items():
            histogram(compute, [model], c.compute)
            sizes = Buckets(ROWS)
            for n_rows, n in c.batch_sizes.items():
                sizes.observe(n_rows, n)
            histogram(rows, [model], sizes)
        yield from (e2e, queued, compute, rows)

    def _queues(self) -> Iterator:
        view = self.view
        depth = GaugeMetricFamily("tgw_queue_depth", "Requests waiting in the broker's queue, by priority level "
                                  "(0 is served first)", labels=["model", "priority"])
        for model in view.batcher.queues:
            for level, n in enumerate(view.batcher.queued_by_level(model)):
                depth.add_metric([model, str(level)], n)
        inflight = GaugeMetricFamily("tgw_inflight_requests", "Requests admitted and not yet answered (queued or "
                                     "computing)", labels=["model", "version"])
        for model, entry in view.models.items():
            for version, rec in entry.records.items():
                inflight.add_metric([model, version], rec.active)
        shed = CounterMetricFamily("tgw_shed", "Requests refused or shed OVERLOADED by the adaptive limit or the "
                                   "queue bound, by priority", labels=["model", "priority"])
        fallbacks = CounterMetricFamily("tgw_breaker_fallbacks", "Requests routed to the model's fallback while "
                                        "its breaker was open", labels=["model"])
        for model, c in view.stats.models.items():
            for priority, n in c.shed.items():
                shed.add_metric([model, str(priority)], n)
            fallbacks.add_metric([model], c.fallbacks)
        yield from (depth, inflight, shed, fallbacks)
