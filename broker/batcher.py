"""Per-model request queues and batch formation - a pure class with an injected clock.

Work-conserving: a free worker gets whatever is queued now (up to max_batch_size rows and
the byte budgets of the worker's input and output arenas); while workers are busy, requests
accumulate and batches grow.
Requests whose deadline has passed are taken out and handed back for a DEADLINE_EXCEEDED
reply; they never reach a worker.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable

from tgw.shm.errors import Code, fail
from tgw.shm.ring import aligned_total


class Pending:
    """One admitted request waiting for, or riding in, a batch."""

    __slots__ = ("client", "req_id", "model", "version", "rows", "shape_key", "tensors", "nbytes",
                 "out_nbytes", "outputs", "deadline", "compress", "attempts", "alone")

    def __init__(self, *, client: Any, req_id: int, model: str, version: str, rows: int, shape_key: tuple,
                 tensors: list, outputs: list[str], deadline: float, compress: bool = False,
                 out_nbytes: list[int] | None = None):
        self.client, self.req_id, self.model, self.version = client, req_id, model, version
        self.rows, self.shape_key, self.outputs = rows, shape_key, outputs
        self.tensors = tensors                      # buffers in declared input order
        self.nbytes = [len(t) for t in tensors]     # per declared input
        # per declared output (the worker writes them all), for its rows; None: some dim is -1,
        # so the size is known only after compute
        self.out_nbytes = out_nbytes
        self.deadline, self.compress = deadline, compress   # deadline: clock seconds
        self.attempts = 0                           # dispatches lost to a dying worker
        self.alone = False                          # runs in a batch of its own (a retry after a death)

    def group(self) -> tuple:
        return (self.version, self.shape_key)


class ModelQueue:
    def __init__(self, name: str, max_batch_size: int, max_queue: int):
        self.name, self.max_batch_size, self.max_queue = name, max_batch_size, max_queue
        self.items: deque[Pending] = deque()


class Batcher:
    SCAN_LIMIT = 256  # how far past the head to look for requests of the head's shape/version

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.queues: dict[str, ModelQueue] = {}
        self._rr: deque[str] = deque()  # round-robin order of models

    def add_model(self, name: str, max_batch_size: int, max_queue: int) -> None:
        self.queues[name] = ModelQueue(name, max_batch_size, max_queue)
        self._rr.append(name)

    def queued(self, model: str | None = None) -> int:
        if model is not None:
            return len(self.queues[model].items)
        return sum(len(q.items) for q in self.queues.values())

    def push(self, p: Pending, front: bool = False) -> None:
        q = self.queues[p.model]
        if not front and len(q.items) >= q.max_queue:
            raise fail(Code.OVERLOADED, f"queue of model {p.model!r} is full ({q.max_queue} requests)",
                       model=p.model, max_queue=q.max_queue)
        (q.items.appendleft if front else q.items.append)(p)

    def expired(self, now: float | None = None) -> list[Pending]:
        """Remove and return every queued request whose deadline has passed (by `now`, else the clock)."""
        now = self.clock() if now is None else now
        return self.take_where(lambda p: p.deadline <= now)

    def take_all(self) -> list[Pending]:
        """Remove and return every queued request."""
        out = [p for q in self.queues.values() for p in q.items]
        for q in self.queues.values():
            q.items.clear()
        return out

    def take_where(self, condition: Callable[[Pending], bool]) -> list[Pending]:
        """Remove and return the queued requests that meet `condition`."""
        out = []
        for q in self.queues.values():
            if any(condition(p) for p in q.items):
                keep = deque()
                for p in q.items:
                    (out if condition(p) else keep).append(p)
                q.items = keep
        return out

    def models_with_work(self) -> list[str]:
        """Models with queued requests, rotated so each gets its turn first."""
        self._rr.rotate(-1)
        return [m for m in self._rr if self.queues[m].items]

    def next_batch(self, model: str, max_bytes: int, max_out_bytes: int | None = None) -> list[Pending]:
        """Pop the head request and those of its group that fit; [] if the queue is empty.

        A batch holds one region per input of aligned size; `max_bytes` caps the whole batch so
        it fits the worker's input arena. Likewise `max_out_bytes` caps its outputs (one aligned
        region per declared output) to the output arena, when every request's output size is
        known: a batch whose outputs cannot fit would fail whole. A head that alone exceeds a
        cap is still returned: the caller answers it (admission normally stops it first)."""
        q = self.queues[model]
        if not q.items:
            return []
        head = q.items.popleft()
        if head.alone:
            return [head]
        batch, rows, sizes, outs = [head], head.rows, list(head.nbytes), head.out_nbytes
        group = head.group()
        skipped: list[Pending] = []
        scanned = 0
        while q.items and rows < q.max_batch_size and scanned < self.SCAN_LIMIT:
            p = q.items.popleft()
            scanned += 1
            if p.alone or p.group() != group or rows + p.rows > q.max_batch_size:
                skipped.append(p)
                continue
            grown, outs_grown = _add(sizes, p.nbytes), _add(outs, p.out_nbytes)
            if _over(grown, max_bytes) or _over(outs_grown, max_out_bytes):
                skipped.append(p)
                break
            batch.append(p)
            rows, sizes, outs = rows + p.rows, grown, outs_grown
        q.items.extendleft(reversed(skipped))  # skipped requests keep their place at the front
        return batch


def _add(sizes: list[int] | None, more: list[int] | None) -> list[int] | None:
    """Region sizes grown by a request's; None (unknown) if either is unknown."""
    return None if sizes is None or more is None else [s + n for s, n in zip(sizes, more)]


def _over(sizes: list[int] | None, cap: int | None) -> bool:
    """Whether one block of these regions overflows `cap` (unknown sizes or no cap: never)."""
    return sizes is not None and cap is not None and aligned_total(sizes) > cap
