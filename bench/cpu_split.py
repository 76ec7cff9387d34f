"""The broker main thread's CPU split by step, in thread CPU time (profile_broker --split).

Where perf cannot count (`perf stat` says "not supported" on this kind of machine) and py-spy's
samples count time spent runnable as well as running, this wraps the broker's per-request and
per-batch steps with `time.thread_time_ns()` and sums each step's CPU while a window is open
(SIGUSR2 opens it, the next one writes the totals). Steps nest: a step's figure includes the
steps it calls, and each wrapped call adds two clock reads (a system call each) to its callers'
figures, so the figures are for before/after comparison of the same steps, not absolutes.
A step missing from the tree under test (an older or newer broker) is left out, not an error.
"""
from __future__ import annotations

import importlib
import json
import os
import time
from typing import Callable

# (label, module, class, method): the first that exists of each label's places is wrapped
STEPS = [
    ("client message: read, admit, queue", "tgw.broker.front.frontdoor", "FrontDoor", "on_message"),
    ("  infer (after the header is read)", "tgw.broker.front.frontdoor", "FrontDoor", "infer"),
    ("    admission", "tgw.broker.sched.admission", "Admission", "admit"),
    ("      per-request object (Pending)", "tgw.broker.sched.admission", "Admission", "_pending"),
    ("worker message: completions", "tgw.broker.worker_messages", "WorkerMessages", "on_message"),
    ("  answer (accounting and replies)", "tgw.broker.front.frontdoor", "FrontDoor", "answer"),
    ("    accounting: stats, metrics, limits", "tgw.broker.sched.admission", "Admission", "leave"),
    ("    accounting: stats, metrics, limits", "tgw.broker.sched.admission", "Admission", "finished"),
    ("    reply: build, encode, send", "tgw.broker.front.frontdoor", "FrontDoor", "reply"),
    ("batching: pump", "tgw.broker.server", "Broker", "pump"),
    ("  dispatch: form, stage, send", "tgw.broker.server", "Broker", "_dispatch"),
]


class Split:
    def __init__(self, clock: Callable[[], int] = time.thread_time_ns):
        self.clock = clock
        self.open = False
        self.totals: dict[str, list[int]] = {}   # label -> [ns, calls] while open

    def install(self) -> list[str]:
        """Wrap each label's first existing place; the labels wrapped."""
        done: list[str] = []
        for label, module, cls, method in STEPS:
            if label in done:
                continue
            klass = getattr(importlib.import_module(module), cls, None)
            fn = getattr(klass, method, None) if klass is not None else None
            if fn is not None:
                setattr(klass, method, self._wrap(fn, self.totals.setdefault(label, [0, 0])))
                done.append(label)
        return done

    def _wrap(self, fn: Callable, acc: list[int]) -> Callable:
        clock, split = self.clock, self

        def timed(*args, **kwargs):
            if not split.open:
                return fn(*args, **kwargs)
            t = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[0] += clock() - t
                acc[1] += 1
        return timed

    def toggle(self, path: str) -> None:
        """Open the window (counters zeroed), or close it and write {label: [ns, calls]} to `path`."""
        if not self.open:
            for acc in self.totals.values():
                acc[0] = acc[1] = 0
            self.open = True
            return
        self.open = False
        with open(path + ".tmp", "w") as f:
            json.dump(self.totals, f)
        os.replace(path + ".tmp", path)


def report(path: str, requests: int, main_us: float) -> None:
    with open(path) as f:
        totals = json.load(f)
    print(f"\nmain thread CPU by step ({path}; thread CPU time, steps nest, each wrapped call adds two clock "
          f"reads): {main_us:.1f} us/request in all, the wrappers' own cost included")
    print(f"  {'us/request':>10}  {'calls/request':>13}  step")
    for label, _, _, _ in STEPS:
        if label in totals:
            ns, calls = totals.pop(label)
            print(f"  {ns / requests / 1000:10.1f}  {calls / requests:13.3f}  {label}")
