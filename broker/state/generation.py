"""What the broker counts of each generator (docs/GENERATION.md): the record `status` and
/metrics read. One writer: the generate wing (broker/generate/), as sequences start, stream and end."""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from .stats import SECONDS, Buckets


@dataclass
class GeneratorCounters:
    """One generator model's figures, over every version and worker."""
    active: int = 0                 # sequences admitted to a worker's loop and not ended
    slots: int = 0                  # slots of the workers that hold a version of it (Steps.slots summed)
    started: int = 0                # sequences admitted to a worker (a resumption counts again)
    ended: Counter = field(default_factory=Counter)   # reason -> sequences (GenerateEnd.reason, cancelled, error)
    outputs: int = 0                # outputs sent to callers
    resumed: int = 0                # sequences prefilled again after their worker died
    freed_by_cancel: int = 0        # slots the workers freed at a cancellation (their own count, summed)
    steps: int = 0                  # Steps messages received
    first_output: Buckets = field(default_factory=lambda: Buckets(SECONDS))     # receipt -> first output, s
    between_outputs: Buckets = field(default_factory=lambda: Buckets(SECONDS))  # one output -> the next, s
    since: float = field(default_factory=time.monotonic)   # when counting began (outputs/s over the life)

    def outputs_per_s(self, now: float | None = None) -> float:
        elapsed = (time.monotonic() if now is None else now) - self.since
        return self.outputs / elapsed if elapsed > 0 else 0.0

    def as_dict(self) -> dict:
        """What status shows (models[m]["generation"])."""
        return {"active": self.active, "slots": self.slots,
                "occupancy": round(self.active / self.slots, 4) if self.slots else 0.0,
                "started": self.started, "ended": dict(self.ended), "outputs": self.outputs,
                "outputs_per_s": round(self.outputs_per_s(), 3), "resumed": self.resumed,
                "freed_by_cancel": self.freed_by_cancel, "steps": self.steps,
                "first_output_ms": _mean_ms(self.first_output), "between_outputs_ms": _mean_ms(self.between_outputs)}


def _mean_ms(b: Buckets) -> float:
    return round(b.sum / b.count * 1000, 3) if b.count else 0.0
