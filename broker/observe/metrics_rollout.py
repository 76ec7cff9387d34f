"""The metric families of shadows and guarded rollouts (canary/, docs/ROLLOUT.md), read from the
status they show (`tgw-broker status` rollouts, `models diff`) at scrape time."""
from __future__ import annotations

from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .status import BrokerView

MEASURES = ("max_abs_diff", "max_rel_error", "top1_agreement", "topk_agreement", "exact_agreement")


def families(view: BrokerView) -> Iterator:
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
