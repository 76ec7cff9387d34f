"""The metric families read from the broker's state at scrape time (broker/observe/metrics.py): the
broker itself, its workers and their rings, the models' versions, breakers and tenants.

Nothing here is on the hot path; the figures come from what `status` and `stats` show
(status.worker_status, status.serving), so the three never disagree.
"""
from __future__ import annotations

from typing import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from tgw.broker.sched.breaker import State as BreakerState
from tgw.broker.state.pool import WorkerState
from tgw.broker.state.versions import VersionState

from .status import BrokerView, listed, serving, worker_status

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
