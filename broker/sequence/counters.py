"""What the broker counts of each sequence model (docs/SEQUENCES.md): the record `status`
(models[m].sequences) and /metrics (tgw_sequence_*) read. One writer: the sequence wing."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class SequenceCounters:
    """One sequence model's figures, over every version and worker."""
    live: int = 0            # sequences bound to a worker's slot now
    slots: int = 0           # state slots of the live workers that hold a version of it
    started: int = 0         # requests with sequence_start admitted (a restart counts again)
    ended: Counter = field(default_factory=Counter)   # reason (end, idle, worker_died, unloaded) -> sequences
    refused: int = 0         # requests refused by the sequence checks (no id, unknown or ended id, ...)
    steps: int = 0           # requests dispatched to the worker that holds their sequence
    misrouted: int = 0       # requests dispatched to a worker that did not hold their sequence (always 0)

    def as_dict(self) -> dict:
        return {"live": self.live, "slots": self.slots, "started": self.started, "ended": dict(self.ended),
                "refused": self.refused, "steps": self.steps, "misrouted": self.misrouted}
