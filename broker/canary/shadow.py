"""Shadow versions (docs/ROLLOUT.md): a version loaded with no traffic of its own that gets a copy
of a fraction of the requests the serving versions answer; its outputs are compared with theirs
and its compute timed, and nobody is answered by it.

A copy is made when the serving version's answer is sent (FrontDoor.answer): its inputs are the
request's own buffers (kept alive by the copy), the serving outputs are copied out of the ring.
It is queued at the model's shadow level, below every priority, which never ages and is shed
first, and runs only on a worker with nothing in flight; a copy that finds the queue full is
dropped, never a caller's request. Not copied: pipeline steps, requests with output regions or
CUDA tensors, requests that named the shadow version themselves.
"""
from __future__ import annotations

from collections import Counter, deque
from typing import Callable, Optional

import numpy as np

from tgw.broker.state.pending import Pending, is_step
from .compare import OutputDiff, worst

TIMES_KEPT = 2048   # compute times kept per side for the p99 (the newest)
ENDED_KEPT = 8


def p99_ms(values, scale: float) -> Optional[float]:
    """The 99th percentile of `values` times `scale`, in ms (None: none yet)."""
    return round(float(np.percentile(np.fromiter(values, float), 99)) * scale, 3) if values else None


class ShadowCaller:
    """A copy's stand-in for a caller: the front door answers it through outputs(); admission's
    leave() tells it of an error (ended)."""
    __slots__ = ("watch", "serving", "serving_us")
    internal = True   # no per-caller cap, no tenant, no region or CUDA lookup (like a pipeline step)
    shadow = True     # ... and none of the model's accounting: its figures are the watch's

    def __init__(self, watch: "ShadowWatch", serving: dict, serving_us: int):
        self.watch, self.serving, self.serving_us = watch, serving, serving_us

    def outputs(self, p: Pending, views: dict) -> None:
        self.watch.compared(p, views, self.serving, self.serving_us)

    def deliver(self, msg, frames) -> None:
        """Errors are counted by ended(); nothing is sent anywhere."""

    def ended(self, p: Pending, code: str) -> None:
        self.watch.failed(code)


class ShadowWatch:
    """One shadow version: what was copied to it and how its answers compared."""

    def __init__(self, model: str, version: str, fraction: float, now: float):
        self.model, self.version, self.fraction, self.started = model, version, fraction, now
        self.owed = 0.0            # copies accrue by fraction per answered request
        self.copied = self.dropped = self.compared_n = 0
        self.failures: Counter = Counter()   # code -> copies answered with it
        self.diffs: dict[str, OutputDiff] = {}
        self.shadow_us: deque[int] = deque(maxlen=TIMES_KEPT)   # its batches' compute, per copy
        self.serving_us: deque[int] = deque(maxlen=TIMES_KEPT)  # the originals', same requests

    def compared(self, p: Pending, views: dict, serving: dict, serving_us: int) -> None:
        self.compared_n += 1
        for name, original in serving.items():
            t, raw = views[name]
            diff = self.diffs.get(name)
            if diff is None:
                diff = self.diffs[name] = OutputDiff(name)
            diff.add(original, (t.dtype, [p.rows, *t.shape[1:]], raw))
        self.shadow_us.append(p.compute_us)
        self.serving_us.append(serving_us)

    def failed(self, code: str) -> None:
        if code == "withdrawn":   # taken out unrun (canary/shadow.py Shadows.stop): no failure of its
            self.dropped += 1
        else:
            self.failures[code] += 1

    def summary(self) -> dict:
        return {"model": self.model, "version": self.version, "fraction": self.fraction, "copied": self.copied,
                "compared": self.compared_n, "failed": dict(self.failures), "dropped": self.dropped,
                "outputs": {name: d.summary() for name, d in sorted(self.diffs.items())},
                "worst": worst(self.diffs),
                "compute_p99_ms": {"shadow": p99_ms(self.shadow_us, 1e-3), "serving": p99_ms(self.serving_us, 1e-3)}}


class Shadows:
    """Every model's shadow (one at a time per model); the one writer of the watches."""

    def __init__(self, models: dict, admit: Callable[[Pending], bool], withdraw: Callable[[str, str], None],
                 clock: Callable[[], float]):
        self.models = models      # the registry's entries by name (timeout, priority levels, records)
        self.admit = admit        # queues a copy at the shadow level; False: the queue is full
        self.withdraw = withdraw  # (model, version): its queued copies out
        self.clock = clock
        self.active: dict[str, ShadowWatch] = {}
        self.ended: deque[dict] = deque(maxlen=ENDED_KEPT)   # the last shadows' final figures, for `models diff`

    def start(self, model: str, version: str, fraction: float) -> ShadowWatch:
        watch = self.active[model] = ShadowWatch(model, version, fraction, self.clock())
        return watch

    def shadow_of(self, model: str) -> Optional[str]:
        """The model's shadow version (None: it has none)."""
        watch = self.active.get(model)
        return watch.version if watch is not None else None

    def stop(self, model: str, versions: list[str] | None = None, why: str = "") -> None:
        """No more copies (the shadow promoted, unloaded, or its model gone): those queued go, its
        final figures are kept among the ended."""
        watch = self.active.get(model)
        if watch is None or (versions is not None and watch.version not in versions):
            return
        del self.active[model]
        self.withdraw(model, watch.version)
        self.ended.append({**watch.summary(), "ended": why, "for_s": round(self.clock() - watch.started, 3)})

    def sample(self, answered: list, now: float) -> None:
        """The requests of one batch just answered (one model and version): copy their share."""
        if not self.active:
            return
        first = answered[0][0]
        watch = self.active.get(first.model)
        if watch is None or first.version == watch.version:
            return
        entry = self.models.get(watch.model)
        record = entry.records.get(watch.version) if entry is not None else None
        if record is None:
            return
        for p, views in answered:
            # a sequence's step is no copy's: its answer comes from state the shadow does not have
            if is_step(p.client) or p.output_region is not None or p.cuda is not None or p.sequence is not None:
                continue
            watch.owed += watch.fraction
            if watch.owed < 1.0:
                continue
            watch.owed -= 1.0
            self._copy(watch, entry, record, p, views, now)

    def _copy(self, watch: ShadowWatch, entry, record, p: Pending, views: dict, now: float) -> None:
        serving = {}
        for name in p.outputs:
            t, raw = views[name]
            serving[name] = (t.dtype, [p.rows, *t.shape[1:]], bytes(raw))   # the ring's blocks go after the reply
        # a region's slice is its caller's again once answered (front/regions.py RegionFrame): copied now
        tensors = [t.kept() if hasattr(t, "kept") else t for t in p.tensors]
        copy = Pending(client=ShadowCaller(watch, serving, p.compute_us), req_id=0, model=p.model,
                       version=watch.version, rows=p.rows, shape_key=p.shape_key, tensors=tensors,
                       outputs=p.outputs, deadline=now + entry.decl.timeout_ms / 1000.0, out_nbytes=p.out_nbytes,
                       priority=entry.decl.priority_levels, arrived=now, record=record)
        if self.admit(copy):
            watch.copied += 1
        else:
            watch.dropped += 1
