"""Prometheus metrics of the broker: what `GET /metrics` and `tgw-broker metrics` serve.

The hot path pays for plain counters only: one hook per request as it leaves (admission's
on_finished: its outcome by version, its end-to-end and queued seconds into fixed buckets) and
a bucket per batch (stats.Stats.batch). Everything else is read from the state the broker
already owns when a scrape comes, by a custom collector on a registry of this broker's own (a
test process may hold several brokers): below the collector, the families of the broker
itself, its workers and their rings, the versions, the scheduler, pipelines and caches (from
what `status` and `stats` show, so the three never disagree), the GPU workers' device figures
(NVML, as their heartbeats carry them: the broker reads none itself) and the shadows' and
guarded rollouts'. The table in docs/OPERATIONS.md (Metrics) lists every family.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from tgw.broker.sched.breaker import State as BreakerState
from tgw.broker.state.pending import Pending
from tgw.broker.state.pool import WorkerState
from tgw.broker.state.stats import Buckets
from tgw.broker.state.versions import VersionState

from .devices import DEVICE_STATES, device_states
from .metrics_gc import gc_families
from .metrics_kept import job_families, sequence_families
from .status import BrokerView, generator_counters, gpu_status, listed, serving, worker_status

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
            s.queue.observe_each([p.dispatched - p.arrived for p in ps if p.dispatched is not None])

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
        yield from broker_families(view, now)
        yield from worker_families(view, now)
        yield from version_families(view, now)
        yield from scheduler_families(view)
        yield from pipeline_families(view)
        yield from cache_families(view)
        yield from generator_families(view)
        yield from sequence_families(view)
        yield from gpu_families(view.roster)
        yield from device_families(view)
        yield from rollout_families(view)
        yield from job_families(view)
        yield from gc_families(view)

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


# ---- the broker's state: the broker, its workers and rings, versions, scheduler, caches, pipelines ----

WORKER = ["worker", "device"]   # worker0[cpu], cpu


def one_hot(fam: GaugeMetricFamily, labels: list[str], states: Iterable, current) -> None:
    """A state as a 0/1 gauge per possible value (the `state` label): 1 for the current one."""
    for s in states:
        fam.add_metric([*labels, s.value], 1.0 if s is current else 0.0)


def broker_families(view: BrokerView, now: float) -> Iterator:
    yield GaugeMetricFamily("tgw_broker_uptime_seconds", "Seconds since the broker started", now - view.started_at)
    phase = GaugeMetricFamily("tgw_broker_phase", "The broker's phase (1 for the current one): starting, serving, "
                              "draining, stopping", labels=["phase"])
    current = view.phase()   # values, not the core's Phase enum: a wing never imports the core
    for value in view.phases:
        phase.add_metric([value], 1.0 if value == current else 0.0)
    yield phase
    yield GaugeMetricFamily("tgw_clients_connected", "Client connections open now", view.callers.connected)
    seen = view.complaints.as_dict()
    refused = CounterMetricFamily("tgw_refused", "Input refused before it reached a queue, by kind (malformed "
                                  "header, limits, authentication, ...)", labels=["kind"])
    for kind, n in seen.get("refused", {}).items():
        refused.add_metric([kind], n)
    dropped = CounterMetricFamily("tgw_replies_dropped", "Replies not delivered (slow reader, caller gone), by "
                                  "reason", labels=["reason"])
    for reason, n in seen.get("dropped", {}).items():
        dropped.add_metric([reason], n)
    abandoned = CounterMetricFamily("tgw_requests_abandoned", "Queued requests dropped unrun because nobody waits "
                                    "for them any more (cancelled, client_closed, client_gone)", labels=["reason"])
    for reason, n in view.abandoned().items():
        abandoned.add_metric([reason], n)
    cancelled = CounterMetricFamily("tgw_requests_cancelled", "Requests withdrawn because nobody waits for them "
                                    "(cancel, caller closed or gone, gRPC cancelled or past its deadline), by where "
                                    "each was: queued, staged (taken out of its batch before launch), computing "
                                    "(computed, its answer dropped), pipeline (a run stopped)", labels=["model", "where"])
    for model, wheres in view.cancelled().items():
        for where, n in wheres.items():
            cancelled.add_metric([model, where], n)
    fronts = view.fronts()
    yield GaugeMetricFamily("tgw_front_processes", "Front processes serving now (said HELLO, not exited); 0 "
                            "without server.front_processes", fronts["alive"])
    yield CounterMetricFamily("tgw_front_restarts", "Times a front process was started again since the broker "
                              "started", fronts["restarts"])
    yield from (refused, dropped, abandoned, cancelled)


def worker_families(view: BrokerView, now: float) -> Iterator:
    def gauge(name: str, doc: str, extra: tuple = ()) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, doc, labels=[*WORKER, *extra])

    state = gauge("tgw_worker_state", "The worker's state (1 for the current one): planned, starting, ready, "
                  "stopping, dead", ("state",))
    restarts = CounterMetricFamily("tgw_worker_restarts", "Times the worker was restarted since the broker "
                                   "started", labels=WORKER)
    inflight = gauge("tgw_worker_inflight_batches", "Batches handed to the worker and not yet completed")
    rss = gauge("tgw_worker_rss_bytes", "Resident memory of the worker process, from its last heartbeat")
    cpu = CounterMetricFamily("tgw_worker_cpu_seconds", "User and system CPU seconds of the worker process, from "
                              "its last heartbeat (restarts from 0 with a new process)", labels=WORKER)
    age = gauge("tgw_worker_heartbeat_age_seconds", "Seconds since the worker's last heartbeat arrived")
    cuda = gauge("tgw_worker_cuda_bytes", "GPU workers: bytes held by torch's allocator, from the last "
                 "heartbeat", ("kind",))
    ring_cap = gauge("tgw_ring_capacity_bytes", "Bytes of each arena of the worker's shared-memory ring", ("arena",))
    # the broker allocates the input arena (exact now); the worker the output one (its last heartbeat)
    ring_used = gauge("tgw_ring_used_bytes", "Bytes of the arena in live blocks (input: batches staged and not "
                      "yet completed, now; output: replies not yet sent, at the worker's last heartbeat)", ("arena",))
    ring_blocks = gauge("tgw_ring_blocks", "Live blocks in the arena (input: batches staged and not yet completed)",
                        ("arena",))
    for w in view.roster:
        labels = [w.name, w.device]
        one_hot(state, labels, WorkerState, w.state)
        seen = worker_status(w, now)
        restarts.add_metric(labels, seen["restarts"])
        inflight.add_metric(labels, seen["inflight"])
        if seen["heartbeat_age_s"] is not None:
            age.add_metric(labels, seen["heartbeat_age_s"])
            rss.add_metric(labels, seen["rss"])
            cpu.add_metric(labels, seen["cpu_s"])
        for kind in ("allocated", "reserved"):
            if f"cuda_{kind}" in seen:
                cuda.add_metric([*labels, kind], seen[f"cuda_{kind}"])
        ring_cap.add_metric([*labels, "input"], w.input_bytes)
        ring_cap.add_metric([*labels, "output"], w.output_bytes)
        ring_used.add_metric([*labels, "input"], w.inputs.used_bytes)
        if w.beat is not None:
            ring_used.add_metric([*labels, "output"], w.beat.output_used)
        ring_blocks.add_metric([*labels, "input"], w.inputs.live_blocks)
    yield from (state, restarts, inflight, rss, cpu, age, cuda, ring_cap, ring_used, ring_blocks)


def version_families(view: BrokerView, now: float) -> Iterator:
    ready = GaugeMetricFamily("tgw_model_ready", "1 while requests that name no version can be served (a ready "
                              "worker holds the default version)", labels=["model"])
    for m in listed(view):
        ready.add_metric([m.name], 1.0 if serving(view, m) else 0.0)
    labels = ["model", "version"]
    state = GaugeMetricFamily("tgw_model_version_state", "Each version's state (1 for the current one): loading, "
                              "ready, draining", labels=[*labels, "state"])
    weight = GaugeMetricFamily("tgw_model_version_weight", "Each version's share of the requests that name no "
                               "version (of the model's sum of weights)", labels=labels)
    loads = CounterMetricFamily("tgw_model_version_loads", "Loads of the version at run time (on demand, "
                                "`models load`, `reload`), over every worker; start-up loads are not counted",
                                labels=labels)
    evictions = CounterMetricFamily("tgw_model_version_evictions", "Evictions of the on-demand version from a "
                                    "worker", labels=labels)
    for m in view.models.values():
        for version, rec in m.records.items():
            one_hot(state, [m.name, version], VersionState, rec.state)
            weight.add_metric([m.name, version], rec.weight)
            loads.add_metric([m.name, version], rec.loads)
            evictions.add_metric([m.name, version], rec.evictions)
    breaker = GaugeMetricFamily("tgw_breaker_state", "Each version's circuit breaker (1 for the current state): "
                                "closed, open, half_open", labels=[*labels, "state"])
    rejected = CounterMetricFamily("tgw_breaker_rejected", "Requests refused CIRCUIT_OPEN by the version's breaker",
                                   labels=labels)
    for (model, version), br in view.breakers.by_key.items():
        one_hot(breaker, [model, version], BreakerState, br.state)
        rejected.add_metric([model, version], br.rejected)
    yield from (ready, state, weight, loads, evictions, breaker, rejected)


def scheduler_families(view: BrokerView) -> Iterator:
    limited = CounterMetricFamily("tgw_tenant_rate_limited", "Requests refused RATE_LIMITED by the tenant's quota, "
                                  "by reason: rate (token bucket) or inflight (its cap)", labels=["tenant", "reason"])
    admitted = CounterMetricFamily("tgw_tenant_admitted", "Requests admitted against the tenant's quota",
                                   labels=["tenant"])
    inflight = GaugeMetricFamily("tgw_tenant_inflight_requests", "The tenant's requests admitted and not yet "
                                 "answered", labels=["tenant"])
    for name, t in view.tenants.by_name.items():
        for reason, n in t.limited.items():
            limited.add_metric([name, reason], n)
        admitted.add_metric([name], t.admitted)
        inflight.add_metric([name], t.inflight)
    limit = GaugeMetricFamily("tgw_concurrency_limit", "The model's adaptive concurrency limit (requests in the "
                              "broker), where one is configured", labels=["model"])
    for model, lim in view.limits.items():
        limit.add_metric([model], lim.limit)
    yield from (limited, admitted, inflight, limit)


def cache_families(view: BrokerView) -> Iterator:
    """Each model's response cache (models[].cache): lookups answered or not, entries dropped, what it holds."""
    hits = CounterMetricFamily("tgw_cache_hits", "Requests answered from the model's response cache, without a "
                               "worker", labels=["model"])
    misses = CounterMetricFamily("tgw_cache_misses", "Requests of a model with a response cache that found no "
                                 "answer kept (computed, then kept)", labels=["model"])
    evictions = CounterMetricFamily("tgw_cache_evictions", "Answers dropped from the response cache, by reason: "
                                    "entries or bytes (its bounds, least recently used first), expired (ttl_s), "
                                    "invalidated (a version retired, the model removed or its cache redeclared)",
                                    labels=["model", "reason"])
    entries = GaugeMetricFamily("tgw_cache_entries", "Answers the response cache holds now", labels=["model"])
    held = GaugeMetricFamily("tgw_cache_bytes", "Bytes the response cache holds now: outputs and keys "
                             "(what max_bytes bounds)", labels=["model"])
    for m in listed(view):
        cache = m.cache
        if cache is None:
            continue
        hits.add_metric([m.name], cache.hits)
        misses.add_metric([m.name], cache.misses)
        for reason, n in cache.evictions.items():
            evictions.add_metric([m.name, reason], n)
        entries.add_metric([m.name], len(cache.entries))
        held.add_metric([m.name], cache.nbytes)
    yield from (hits, misses, evictions, entries, held)


def generator_families(view: BrokerView) -> Iterator:
    """Each generator model's sequences, slots and outputs (status' models[].generation)."""
    active = GaugeMetricFamily("tgw_generator_active_sequences", "Sequences in a worker's step loop now "
                               "(admitted, not ended)", labels=["model"])
    slots = GaugeMetricFamily("tgw_generator_slots", "State slots of the workers that hold a version of the "
                              "generator (at most that many sequences run at once)", labels=["model"])
    outputs = CounterMetricFamily("tgw_generator_outputs", "Outputs sent to callers", labels=["model"])
    ended = CounterMetricFamily("tgw_generator_sequences", "Sequences ended, by reason (max_outputs, stop_token, "
                                "stop_sequence, max_length, done, cancelled, error)", labels=["model", "reason"])
    resumed = CounterMetricFamily("tgw_generator_resumed", "Sequences prefilled again after their worker died",
                                  labels=["model"])
    first = HistogramMetricFamily("tgw_generator_first_output_seconds", "Seconds from the broker's receipt of a "
                                  "generation to its first output", labels=["model"])
    between = HistogramMetricFamily("tgw_generator_between_outputs_seconds", "Seconds from one output of a "
                                    "sequence to its next", labels=["model"])
    for m in listed(view):
        c = generator_counters(view, m)
        if c is None:
            continue
        active.add_metric([m.name], c.active)
        slots.add_metric([m.name], c.slots)
        outputs.add_metric([m.name], c.outputs)
        for reason, n in sorted(c.ended.items()):
            ended.add_metric([m.name, reason], n)
        resumed.add_metric([m.name], c.resumed)
        histogram(first, [m.name], c.first_output)
        histogram(between, [m.name], c.between_outputs)
    yield from (active, slots, outputs, ended, resumed, first, between)


def pipeline_families(view: BrokerView) -> Iterator:
    """Each pipeline's answers by code, its runs in flight, and the seconds of each step."""
    requests = CounterMetricFamily("tgw_pipeline_requests", "Requests naming a pipeline, by outcome code (OK: "
                                   "answered with outputs; ABANDONED: cancelled or caller gone)",
                                   labels=["pipeline", "code"])
    inflight = GaugeMetricFamily("tgw_pipeline_inflight", "Pipeline requests started and not yet answered",
                                 labels=["pipeline"])
    steps = HistogramMetricFamily("tgw_pipeline_step_seconds", "Seconds from a step's request to its answer, "
                                  "every answer", labels=["pipeline", "step"])
    for name, c in view.pipelines.counters.items():
        requests.add_metric([name, "OK"], c.replies)
        for code, n in c.errors.items():
            requests.add_metric([name, code], n)
        if c.abandoned:
            requests.add_metric([name, "ABANDONED"], c.abandoned)
        inflight.add_metric([name], c.inflight)
        for step, s in c.steps.items():
            steps.add_metric([name, step], [(floatToGoString(le), n) for le, n in s.seconds.cumulative()],
                             s.seconds.sum)
    yield from (requests, inflight, steps)


# ---- the GPU workers' devices: memory, utilisation, temperature, power (from heartbeats), states and faults ----

# name, help, GpuReading field
READINGS: list[tuple[str, str, str]] = [
    ("tgw_gpu_memory_used_bytes", "Device memory in use, by every process on the worker's GPU, at its last "
     "heartbeat", "memory_used"),
    ("tgw_gpu_memory_total_bytes", "Device memory of the worker's GPU", "memory_total"),
    ("tgw_gpu_utilization_ratio", "Fraction of NVML's last sample period in which a kernel ran on the worker's "
     "GPU (0-1), at its last heartbeat", "utilization"),
    ("tgw_gpu_temperature_celsius", "Core temperature of the worker's GPU, at its last heartbeat", "temperature_c"),
    ("tgw_gpu_power_watts", "Power drawn by the worker's GPU board, at its last heartbeat", "power_w"),
]


def gpu_families(workers: Iterable) -> Iterator:
    """A family per reading and the OOM counter, with samples labelled (worker, device) from each
    worker's last heartbeat (`workers`: the roster, or anything with name, device and beat)."""
    fams = [GaugeMetricFamily(name, doc, labels=WORKER) for name, doc, _ in READINGS]
    ooms = CounterMetricFamily("tgw_worker_gpu_oom", "GPU workers: CUDA out-of-memory errors the worker met, "
                               "those recovered by splitting the batch included, from its last heartbeat "
                               "(restarts from 0 with a new process)", labels=WORKER)
    for w in workers:
        seen = gpu_status(w)
        if not seen:
            continue
        labels = [w.name, w.device]
        ooms.add_metric(labels, seen["gpu_ooms"])
        for fam, (_, _, field) in zip(fams, READINGS):
            figure = (seen.get("gpu") or {}).get(field)
            if figure is not None:
                fam.add_metric(labels, float(figure))
    yield from fams
    yield ooms


def device_families(view: BrokerView) -> Iterator:
    """Each device's state (devices.py) one-hot, and the sticky CUDA errors met on it."""
    state = GaugeMetricFamily("tgw_device_state", "The device's state (1 for the current one): serving, starting, "
                              "restarting, faulted (its worker met a sticky CUDA error and is being replaced), "
                              "out_of_service (repeated faults: no worker starts there for a while)",
                              labels=["device", "uuid", "state"])
    faults = CounterMetricFamily("tgw_worker_cuda_faults", "Sticky CUDA errors (illegal memory access, "
                                 "device-side assert, launch failure, ECC, ...) that ended a worker on the device "
                                 "since the broker started", labels=["device", "uuid"])
    for device, d in device_states(view).items():
        for s in DEVICE_STATES:
            state.add_metric([device, d["uuid"], s], 1.0 if s == d["state"] else 0.0)
        faults.add_metric([device, d["uuid"]], d["faults"])
    yield state
    yield faults


# ---- shadows and guarded rollouts (canary/, docs/ROLLOUT.md), from the status they show ----------

MEASURES = ("max_abs_diff", "max_rel_error", "top1_agreement", "topk_agreement", "exact_agreement")


def rollout_families(view: BrokerView) -> Iterator:
    r = view.rollouts()
    requests = CounterMetricFamily("tgw_shadow_requests", "Copies of answered requests sent to a shadow version, by "
                                   "outcome: copied (queued), compared (answered and compared), dropped (the queue "
                                   "was full, or withdrawn unrun), failed", labels=["model", "version", "outcome"])
    diverge = GaugeMetricFamily("tgw_shadow_divergence", "A shadow's outputs against the serving version's, per "
                                "output: max_abs_diff, max_rel_error, top1_agreement, topk_agreement, "
                                "exact_agreement (shares in [0, 1])", labels=["model", "version", "output", "measure"])
    compute = GaugeMetricFamily("tgw_shadow_compute_p99_seconds", "The p99 of the compute of a shadow's batches "
                                "(side shadow) and of the batches that answered the same requests (side serving)",
                                labels=["model", "version", "side"])
    for s in [*r.get("shadows", []), *r.get("ended_shadows", [])]:
        labels = [s["model"], s["version"]]
        failed = sum(s["failed"].values())
        for outcome, n in (("copied", s["copied"]), ("compared", s["compared"]), ("dropped", s["dropped"]),
                           ("failed", failed)):
            requests.add_metric([*labels, outcome], n)
    for s in r.get("shadows", []):
        for output, o in s["outputs"].items():
            for measure in MEASURES:
                if measure in o:
                    diverge.add_metric([s["model"], s["version"], output, measure], o[measure])
        for side, ms in s["compute_p99_ms"].items():
            if ms is not None:
                compute.add_metric([s["model"], s["version"], side], ms / 1000)
    decisions = CounterMetricFamily("tgw_rollout_decisions", "Guarded rollouts decided: promote or rollback",
                                    labels=["model", "decision"])
    for d in r.get("decisions_total", []):
        decisions.add_metric([d["model"], d["decision"]], d["n"])
    guarded = GaugeMetricFamily("tgw_rollout_guarded", "Versions watched by a rollout policy now (1), by kind "
                                "(canary or shadow)", labels=["model", "version", "kind"])
    for g in r.get("guarded", []):
        guarded.add_metric([g["model"], g["version"], g["kind"]], 1.0)
    yield from (requests, diverge, compute, decisions, guarded)
