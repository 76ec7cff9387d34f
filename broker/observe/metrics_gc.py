"""The Prometheus families of garbage collection (metrics.py's collector yields them with the
rest): the broker's own figures and each worker's from its last heartbeat, as status' `gc`
shows them (status.gc_figures; shm/gc_watch.py measures them in every process)."""
from __future__ import annotations

from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .status import BrokerView, gc_figures


def processes(view: BrokerView) -> list[tuple[str, dict]]:
    """(process label, figures): "broker", then "worker-N" for each worker that has beaten."""
    figures = gc_figures(view)
    return [("broker", figures["broker"])] + [(f"worker-{n}", f) for n, f in figures["workers"].items()]


def gc_families(view: BrokerView) -> Iterator:
    longest = GaugeMetricFamily("tgw_gc_longest_pause_seconds", "The longest garbage-collection pause of the "
                                "process since it started (the freeze's own collection not counted)",
                                labels=["process"])
    collections = CounterMetricFamily("tgw_gc_collections", "Garbage collections of the process, by generation "
                                      "(2: full)", labels=["process", "generation"])
    slow = CounterMetricFamily("tgw_gc_slow_pauses", "Garbage-collection pauses longer than 1 ms",
                               labels=["process"])
    frozen = GaugeMetricFamily("tgw_gc_frozen_objects", "Objects gc.freeze() set aside after start-up, which no "
                               "collection walks (0: not frozen, server.gc_freeze false)", labels=["process"])
    for name, f in processes(view):
        longest.add_metric([name], f.get("longest_pause_ms", 0.0) / 1e3)
        for generation, n in sorted(f.get("collections", {}).items()):
            collections.add_metric([name, generation], n)
        slow.add_metric([name], f.get("pauses_over_1ms", 0))
        frozen.add_metric([name], f.get("frozen_objects", 0))
    yield from (longest, collections, slow, frozen)
