"""The adaptive concurrency limit of a model: how many of its requests may be in the broker at
once (queued or computing), steered by latency against the model's slo_p99_ms.

AIMD on windows: every WINDOW_S (once it holds MIN_SAMPLES answers) the window's p99 of
end-to-end latency of the requests answered with outputs (admission to answer) is compared with
the SLO. Over it, the limit shrinks in proportion (limit x slo/p99, at most halving); well under
it (below HEADROOM x slo) and the limit was reached in that window, it grows by 1 + limit/16.
Between the two it holds. It starts at twice the floor; the floor is the full batches the
workers may hold plus one forming (a smaller limit could only starve them); the ceiling is
max_queue. By Little's law the limit settles near SLO x throughput,
so a queue never grows past what can still be answered within the SLO; the excess is shed at
admission, lowest priority first: level l of L may fill only the share 1 - l / (2 L) of the
limit (all of it for level 0, two thirds for level 2 of 3), so the lower levels are refused
while the higher ones still have room - including room the batches computing now hold, which
no shedding of queued requests could free - and when the limit is full a queued request of a
lower level is shed for a higher one (batcher.shed_for).
"""
from __future__ import annotations

WINDOW_S = 0.1
MIN_SAMPLES = 5
HEADROOM = 0.8


class AdaptiveLimit:
    def __init__(self, slo_s: float, floor: int, ceiling: int, initial: int | None = None, now: float = 0.0,
                 levels: int = 1):
        self.slo, self.floor, self.ceiling, self.levels = slo_s, max(1, floor), max(floor, ceiling), levels
        self.limit = float(min(self.ceiling, max(self.floor, initial or 2 * floor)))
        self.inflight = 0               # admitted, not yet answered
        self.samples: list[float] = []
        self.window_start = now
        self.binding = False            # the limit turned a request away (or shed one) this window
        self.last_p99 = 0.0
        self.decreases = self.increases = 0

    def full(self, priority: int = 0) -> bool:
        """Whether a request of `priority` (0 .. levels-1) finds no room under the limit."""
        if self.inflight >= max(1, int(self.limit * (1 - priority / (2 * self.levels)))):
            self.binding = True
            return True
        return False

    def record(self, latency_s: float, now: float) -> None:
        samples = self.samples
        samples.append(latency_s)
        if now - self.window_start >= WINDOW_S and len(samples) >= MIN_SAMPLES:
            self._adjust(now)

    def _adjust(self, now: float) -> None:
        samples = sorted(self.samples)
        p99 = samples[min(len(samples) - 1, int(0.99 * len(samples)))]
        if p99 > self.slo:
            self.limit = max(self.floor, self.limit * max(0.5, self.slo / p99))
            self.decreases += 1
        elif self.binding and p99 < HEADROOM * self.slo:
            self.limit = min(self.ceiling, self.limit + 1 + self.limit / 16)
            self.increases += 1
        self.last_p99 = p99
        self.samples.clear()
        self.binding = False
        self.window_start = now

    def as_dict(self) -> dict:
        return {"limit": int(self.limit), "inflight": self.inflight, "slo_ms": round(self.slo * 1000, 3),
                "window_p99_ms": round(self.last_p99 * 1000, 3), "decreases": self.decreases,
                "increases": self.increases, "floor": self.floor, "ceiling": self.ceiling}
