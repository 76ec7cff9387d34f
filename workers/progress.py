"""What the serving loop is doing, for the beacon's heartbeats: written by the loop's thread,
read by the beacon's. Its own module so the loop does not import the beacon."""
from __future__ import annotations

import time


class Progress:
    """Single attribute writes are atomic under the GIL. start() writes batch_since before
    batch_id and readers read batch_id first, so a new id is never paired with an older time."""

    def __init__(self):
        self.batches = 0                  # batches completed since start
        self.batch_id: int | None = None  # the batch computing now, if any
        self.batch_since = 0.0            # CLOCK_MONOTONIC when it started
        self.outputs = None               # the output arena's allocator (its in_use is read)
        self.gpu_ooms = 0                 # CUDA out-of-memory errors met, those recovered by splitting too

    def start(self, batch_id: int) -> None:
        self.batch_since = time.monotonic()
        self.batch_id = batch_id

    def end(self) -> None:
        self.batch_id = None
        self.batches += 1
