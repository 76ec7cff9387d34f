"""Whether a worker's memory is leaking - a pure judgement over its heartbeats.

Each life of each worker keeps its (time, batches, RSS) over `leak.window_s`. With at least
`min_samples` of them, a least-squares slope of RSS over time (MiB/min) or over batches
(MiB per 1,000 batches) above its configured limit is a leak, and so is RSS over the ceiling.
A fit over the whole window, not two points, so one large allocation is not a trend; only
beats of a serving worker count (loading is not leaking), a time slope needs half the window
covered and a batch slope MIN_BATCHES batches.
"""
from __future__ import annotations

from collections import deque

from tgw.shm.wire import Heartbeat

from tgw.broker.config.load import LeakDecl

MIB = 1 << 20
MIN_BATCHES = 100


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs; 0 when xs do not vary."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


class LeakJudge:
    def __init__(self, decl: LeakDecl):
        self.decl = decl
        self.history: dict[bytes, deque] = {}   # worker identity (one life) -> (t, batches, rss)

    @property
    def enabled(self) -> bool:
        d = self.decl
        return d.mib_per_min is not None or d.mib_per_1k_batches is not None or d.rss_ceiling_mb is not None

    def record(self, identity: bytes, beat: Heartbeat, now: float) -> str:
        """Keep this beat; returns why the worker is leaking, or ""."""
        if not self.enabled:
            return ""
        h = self.history.setdefault(identity, deque())
        h.append((now, beat.batches, beat.rss))
        while h[0][0] < now - self.decl.window_s:
            h.popleft()
        return self.verdict(h)

    def samples(self, identity: bytes) -> list[dict]:
        return [{"t": t, "batches": b, "rss": r} for t, b, r in self.history.get(identity, ())]

    def forget(self, identity: bytes) -> None:
        self.history.pop(identity, None)

    def verdict(self, h: deque) -> str:
        d, rss = self.decl, h[-1][2]
        if d.rss_ceiling_mb is not None and rss > d.rss_ceiling_mb * MIB:
            return f"RSS {rss / MIB:.0f} MiB is over rss_ceiling_mb {d.rss_ceiling_mb}"
        if len(h) < d.min_samples:
            return ""
        ts, batches, rsses = zip(*h)
        seconds, done = ts[-1] - ts[0], batches[-1] - batches[0]
        span = f"over {seconds:.0f} s and {done} batches"
        per_min = slope(ts, rsses) * 60 / MIB
        if d.mib_per_min is not None and seconds >= d.window_s / 2 and per_min > d.mib_per_min:
            return f"RSS rising {per_min:.1f} MiB/min {span} (limit mib_per_min {d.mib_per_min:g})"
        per_1k = slope(batches, rsses) * 1000 / MIB
        if d.mib_per_1k_batches is not None and done >= MIN_BATCHES and per_1k > d.mib_per_1k_batches:
            return f"RSS rising {per_1k:.1f} MiB per 1,000 batches {span} (limit mib_per_1k_batches " \
                   f"{d.mib_per_1k_batches:g})"
        return ""
