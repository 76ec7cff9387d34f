"""The Prometheus families of what the broker keeps between one caller's requests (metrics.py's
collector yields them with the rest): sequence models' bindings (docs/SEQUENCES.md) and polled
jobs (docs/JOBS.md), read from their wings' counters when a scrape comes."""
from __future__ import annotations

from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .status import BrokerView, listed, sequence_counters

JOB_COUNTS = ("submitted", "done", "failed", "cancelled", "expired", "evicted", "refused", "too_large")


def sequence_families(view: BrokerView) -> Iterator:
    """Each sequence model's live sequences, slots, starts, ends and refusals (status' models[].sequences)."""
    live = GaugeMetricFamily("tgw_sequence_live", "Sequences bound to a worker's state slot now", labels=["model"])
    slots = GaugeMetricFamily("tgw_sequence_slots", "State slots of the workers that hold a version of the model",
                              labels=["model"])
    started = CounterMetricFamily("tgw_sequence_started", "Requests with sequence_start admitted", labels=["model"])
    ended = CounterMetricFamily("tgw_sequence_ended", "Sequences ended, by reason (end, idle, worker_died, unloaded)",
                                labels=["model", "reason"])
    refused = CounterMetricFamily("tgw_sequence_refused", "Requests refused by the sequence checks (no id, an "
                                  "unknown or ended id, ...)", labels=["model"])
    steps = CounterMetricFamily("tgw_sequence_steps", "Requests dispatched to the worker holding their sequence",
                                labels=["model"])
    misrouted = CounterMetricFamily("tgw_sequence_misrouted", "Requests dispatched to a worker that did not hold "
                                    "their sequence (always 0)", labels=["model"])
    for m in listed(view):
        c = sequence_counters(view, m)
        if c is None:
            continue
        for family, value in ((live, c.live), (slots, c.slots), (started, c.started), (refused, c.refused),
                              (steps, c.steps), (misrouted, c.misrouted)):
            family.add_metric([m.name], value)
        for reason, n in sorted(c.ended.items()):
            ended.add_metric([m.name, reason], n)
    yield from (live, slots, started, ended, refused, steps, misrouted)


def job_families(view: BrokerView) -> Iterator:
    """Polled jobs (docs/JOBS.md): those held now, their bytes, and every way one ended or went."""
    jobs = view.jobs()
    if not jobs:
        return
    held = GaugeMetricFamily("tgw_jobs", "Polled jobs held now: live (queued or running) and kept (ended, "
                             "kept jobs.keep_s)", labels=["state"])
    held.add_metric(["live"], jobs["live"])
    held.add_metric(["kept"], jobs["kept"])
    yield held
    yield GaugeMetricFamily("tgw_jobs_bytes", "Bytes of outputs the jobs hold now (bound: jobs.max_result_bytes)",
                            jobs["bytes"])
    events = CounterMetricFamily("tgw_jobs_events", "Jobs by what happened to them: submitted, done, failed, "
                                 "cancelled, expired (past keep_s), evicted (room for newer results), refused "
                                 "(max_jobs), too_large (max_result_bytes)", labels=["event"])
    for name in JOB_COUNTS:
        events.add_metric([name], jobs[name])
    yield events
