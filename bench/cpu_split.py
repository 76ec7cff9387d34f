"""The broker main thread's CPU split by step, in thread CPU time (profile_broker --split).

Where perf cannot count and py-spy's samples count time spent runnable as well as running, this
wraps the broker's per-request and per-batch steps with `time.thread_time_ns()` and sums each
step's CPU while a window is open (SIGUSR2 opens it, the next one writes the totals). Steps nest:
a step's figure includes the steps it calls, and each wrapped call adds two clock reads (a system
call each) to its callers' figures, so the figures are for before/after comparison of the same
steps, not absolutes. A step missing from the tree under test is left out, not an error.
Brought back from bfd3729 for issue 43 (its step table follows the modules as they are now).
"""
from __future__ import annotations

import importlib
import json
import os
import time
from typing import Callable

# (label, module, class, method): the first that exists of each label's places is wrapped
STEPS = [
    ("client socket: drain (recv + every message)", "tgw.broker.front.sockets", "Pump", "drain"),
    ("  client message: read, admit, queue", "tgw.broker.front.frontdoor", "FrontDoor", "on_message"),
    ("    header decode and checks", "tgw.broker.front.frontdoor", None, "read_request"),
    ("  infer (after the header is read)", "tgw.broker.front.frontdoor", "FrontDoor", "_infer"),
    ("    admission", "tgw.broker.sched.admission", "Admission", "admit"),
    ("      per-request object (Pending)", "tgw.broker.sched.admission", "Admission", "_pending"),
    ("worker message: completions", "tgw.broker.core.serving", "WorkerMessages", "on_message"),
    ("  answer (accounting and replies)", "tgw.broker.front.frontdoor", "FrontDoor", "answer"),
    ("    accounting: stats, metrics, limits", "tgw.broker.sched.admission", "Admission", "leave"),
    ("    reply: build, encode, send", "tgw.broker.front.frontdoor", "FrontDoor", "reply"),
    ("      outbox send (copy out, zmq send)", "tgw.broker.front.outbound", "Outbox", "send"),
    ("batching: pump", "tgw.broker.core.serving", "Serving", "pump"),
    ("  dispatch: form, stage, send", "tgw.broker.core.serving", "Serving", "_dispatch"),
    ("    batch formation", "tgw.broker.sched.batcher", "Batcher", "next_batch"),
    ("gRPC: request decode", "tgw.broker.faces.grpc.infer", "Inference", "decode"),
    ("gRPC: reply encode", "tgw.broker.faces.grpc.tensors", None, "encode"),
    ("gRPC: stream answer", "tgw.broker.faces.grpc.infer", "Stream", "answered"),
]


class Split:
    def __init__(self, clock: Callable[[], int] = time.thread_time_ns):
        self.clock = clock
        self.open = False
        self.totals: dict[str, list[int]] = {}   # label -> [ns, calls] while open

    def install(self) -> list[str]:
        """Wrap each label's first existing place (a module function when `class` is None)."""
        done: list[str] = []
        for label, module, cls, method in STEPS:
            if label in done:
                continue
            mod = importlib.import_module(module)
            owner = mod if cls is None else getattr(mod, cls, None)
            fn = getattr(owner, method, None) if owner is not None else None
            if fn is None:
                continue
            wrapped = self._wrap(fn, self.totals.setdefault(label, [0, 0]))
            setattr(owner, method, wrapped)
            if cls is None:   # a function imported by name elsewhere: those names too
                for other in list(_importers(mod, method, fn)):
                    setattr(other, method, wrapped)
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


def _importers(mod, name: str, fn: Callable):
    import sys
    for other in list(sys.modules.values()):
        if other is not mod and other is not None and getattr(other, name, None) is fn:
            yield other


def report(path: str, requests: int, main_us: float) -> list[str]:
    with open(path) as f:
        totals = json.load(f)
    lines = [f"main thread CPU by step ({os.path.basename(path)}; thread CPU time, steps nest, each wrapped call "
             f"adds two clock reads): {main_us:.1f} us/request in all, the wrappers' own cost included",
             f"  {'us/request':>10}  {'calls/request':>13}  step"]
    for label, _, _, _ in STEPS:
        if label in totals:
            ns, calls = totals.pop(label)
            lines.append(f"  {ns / requests / 1000:10.1f}  {calls / requests:13.3f}  {label}")
    return lines


def cprofile_report(path: str, n: int, main_us: float, top: int) -> list[str]:
    """The top functions of a cProfile dump by own time: % of the profiled time, µs per request
    (that share of the unprofiled main thread's CPU) and calls per request."""
    import pstats
    st = pstats.Stats(path).stats  # (file, line, name) -> (primitive calls, calls, tottime, cumtime, callers)
    total = sum(v[2] for v in st.values())
    lines = [f"cProfile (uvloop thread; {os.path.basename(path)}): {total / n * 1e6:.1f} us/request profiled (the "
             f"profiler's own cost inflates it) vs {main_us:.1f} unprofiled; us/request = share x {main_us:.1f}"]

    def name(k) -> str:
        f, line, fn = k
        return fn if f == "~" else f"{fn} ({'/'.join(f.split('/')[-2:])}:{line})"
    for title, idx in (("own time", 2), ("inclusive time", 3)):
        lines.append(f"top {top} by {title}:   share   us/req  calls/req")
        for k, v in sorted(st.items(), key=lambda kv: -kv[1][idx])[:top]:
            lines.append(f"  {v[idx] / total:6.1%} {v[idx] / total * main_us:7.1f}  {v[1] / n:8.2f}  {name(k)}")
    return lines
