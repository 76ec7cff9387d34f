"""A batch with some of its requests withdrawn before launch: the batch the worker runs instead.

The kept requests' batch has their rows, splits, traces, ids and CUDA descriptors, and the inputs of
the batch as sent (the ring block is the broker's: the worker never writes it). Each input is
read as sent and its kept rows taken (`Shrunk.rows_of`): a view when they are one run of rows,
else one gather. Everything after that (the forward, output blocks, parts, a stage's failed
rows) counts the kept requests only, so Done's `first`, `count` and `failed` do too, and
Done.withdrawn tells the broker which requests of the batch as sent were left out.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from tgw.shm.wire import Batch


@dataclass
class Shrunk:
    batch: Batch                      # the kept requests' batch
    withdrawn: list[int]              # indices, in the batch as sent, of the requests left out
    runs: list[tuple[int, int]]       # the kept rows of the batch as sent: [start, end) runs, in order

    def rows_of(self, x):
        """The kept rows of `x` (a tensor or list whose first dim is the batch's rows as sent)."""
        runs = self.runs
        if len(runs) == 1:
            a, b = runs[0]
            return x[a:b]   # a view of a tensor: no copy
        if isinstance(x, list):
            return [row for a, b in runs for row in x[a:b]]
        import torch
        return torch.cat([x[a:b] for a, b in runs]) if runs else x[:0]


def shrink(batch: Batch, gone: set[int]) -> Shrunk | None:
    """The batch without the requests `gone` (indices into its splits); None when none of them
    is one of its requests (nothing to take out)."""
    splits = batch.splits if sum(batch.splits) == batch.rows else [batch.rows]
    withdrawn = sorted(i for i in gone if 0 <= i < len(splits))
    if not withdrawn:
        return None
    starts = list(itertools.accumulate(splits, initial=0))
    kept = [i for i in range(len(splits)) if i not in gone]
    runs: list[tuple[int, int]] = []
    for i in kept:
        a, b = starts[i], starts[i + 1]
        if runs and runs[-1][1] == a:
            runs[-1] = (runs[-1][0], b)
        elif b > a:
            runs.append((a, b))
    derived = Batch(batch_id=batch.batch_id, model=batch.model, version=batch.version,
                    rows=sum(splits[i] for i in kept), block=batch.block, inputs=batch.inputs,
                    deadline=batch.deadline, release=batch.release, splits=[splits[i] for i in kept],
                    traces=[batch.traces[i] for i in kept] if batch.traces else [],
                    ids=[batch.ids[i] for i in kept] if batch.ids else [],
                    cuda_inputs=[batch.cuda_inputs[i] for i in kept] if batch.cuda_inputs else [],
                    cuda_outputs=[batch.cuda_outputs[i] for i in kept] if batch.cuda_outputs else [],
                    steps=[batch.steps[i] for i in kept] if batch.steps else [])
    return Shrunk(derived, withdrawn, runs)
