"""Per-model priority queues and batch formation - a pure class with an injected clock.

Each model has `priority_levels` FIFO queues, level 0 served first. Aging keeps a low level
from starving while capacity exists: a request that has waited `aging_batches` times the
model's recent batch time (the cost model's) counts one level higher, two such spans two
levels, and so on down to 0; the head whose effective level is lowest goes first (ties: the
older). Batches never mix versions or variable shapes but do
mix priorities: a batch is filled from level 0 down.

Work-conserving by default: a free worker gets whatever is queued now (up to max_batch_size
rows and the byte budgets of the worker's arenas). With `max_delay_us` the batcher may hold a
batch to let it grow towards `preferred_batch_sizes` (or max_batch_size), but only until the
first queued request's deadline minus the predicted compute of the batch it waits for.
Requests whose deadline has passed - or that no batch could finish in time even if dispatched
now - are taken out and handed back for a DEADLINE_EXCEEDED reply; they never reach a worker.
When a queue is full the youngest request of the lowest level present makes room for a request
of a higher level (shed, answered OVERLOADED). Below every level is the shadow level: copies for
a shadow version (canary/shadow.py), which never age, so they go only when nothing else waits,
are held for a full batch (up to SHADOW_HOLD_S) and are shed first.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable, Iterator

from tgw.shm.errors import Code, fail
from tgw.shm.ring import ALIGN, aligned_total

from .costmodel import CostModel
from tgw.broker.state.pending import Pending

__all__ = ["Batcher", "ModelQueue", "Pending"]
SHADOW_HOLD_S = 0.05   # shadow copies wait this long for a full batch (they answer nobody)


class ModelQueue:
    def __init__(self, name: str, max_batch_size: int, max_queue: int, levels: int = 1, max_delay_us: int = 0,
                 preferred: list[int] | tuple = (), aging_batches: float = 8.0):
        self.name, self.max_batch_size, self.max_queue = name, max_batch_size, max_queue
        self.levels: list[deque[Pending]] = [deque() for _ in range(levels + 1)]   # the last: shadow copies
        self.shadow_level = levels
        self.max_delay = max_delay_us / 1e6
        self.preferred = sorted(set(preferred))
        self.aging_batches = aging_batches
        self.count = 0

    @property
    def items(self) -> list[Pending]:
        """Everything queued, level 0 first, each level in its order."""
        return [p for q in self.levels for p in q]

    def lowest(self) -> int | None:
        """The lowest (numerically highest) level holding a request."""
        for level in range(len(self.levels) - 1, -1, -1):
            if self.levels[level]:
                return level
        return None


class Batcher:
    SCAN_LIMIT = 256  # how far past the head to look for requests of the head's shape/version

    def __init__(self, clock: Callable[[], float] = time.monotonic, costs: CostModel | None = None):
        self.clock = clock
        self.costs = costs or CostModel()
        self.queues: dict[str, ModelQueue] = {}
        self._rr: deque[str] = deque()  # round-robin order of models

    def add_model(self, name: str, max_batch_size: int, max_queue: int, **policy) -> None:
        """`policy`: levels, max_delay_us, preferred, aging_batches (ModelQueue's). A model declared
        again (removed, then added back at run time) gets a fresh queue with its new policy."""
        if name not in self.queues:
            self._rr.append(name)
        self.queues[name] = ModelQueue(name, max_batch_size, max_queue, **policy)

    def declare(self, m) -> None:
        """A queue for a model declaration (config.ModelDecl)."""
        self.add_model(m.name, m.max_rows, m.max_queue, levels=m.priority_levels, max_delay_us=m.max_delay_us,
                       preferred=m.preferred_batch_sizes, aging_batches=m.aging_batches)

    def set_max_queue(self, model: str, n: int) -> None:
        """A served model's queue bound changed (a reload's models[].max_queue)."""
        self.queues[model].max_queue = n

    def queued(self, model: str | None = None) -> int:
        if model is not None:
            return self.queues[model].count
        return sum(q.count for q in self.queues.values())

    def full(self, model: str) -> bool:
        """Whether `model`'s queue holds a full batch's requests (max_batch_size of them)."""
        q = self.queues[model]
        return q.count >= q.max_batch_size

    def queued_by_level(self, model: str) -> list[int]:
        """Callers' requests per priority level (shadow copies are not callers')."""
        q = self.queues[model]
        return [len(level) for level in q.levels[:q.shadow_level]]

    def push(self, p: Pending, front: bool = False) -> Pending | None:
        """Queue `p`; a full queue sheds its youngest lowest-level request for a higher-level one
        (returned: the caller answers it OVERLOADED) or refuses `p` (raises OVERLOADED). A request
        pushed back to the front (a requeue after a worker death) is always taken."""
        q = self.queues[p.model]
        shed = None
        if not front and q.count >= q.max_queue:
            shed = self.shed_for(p)
            if shed is None:
                raise fail(Code.OVERLOADED, f"queue of model {p.model!r} is full ({q.max_queue} requests)",
                           model=p.model, max_queue=q.max_queue, priority=p.priority, reason="queue_full")
        level = q.levels[min(p.priority, len(q.levels) - 1)]
        (level.appendleft if front else level.append)(p)
        q.count += 1
        return shed

    def remove(self, p: Pending) -> bool:
        """Take `p` out of its queue (a cancel); False when it is not queued (running, or answered)."""
        q = self.queues.get(p.model)
        if q is None:
            return False
        try:
            q.levels[min(p.priority, len(q.levels) - 1)].remove(p)
        except ValueError:
            return False
        q.count -= 1
        return True

    def shed_for(self, p: Pending) -> Pending | None:
        """Take out the youngest queued request of the lowest level below `p`'s, to make room
        for `p`; None when nothing queued ranks lower (then `p` itself is the one to refuse)."""
        q = self.queues[p.model]
        low = q.lowest()
        if low is None or low <= p.priority:
            return None
        q.count -= 1
        return q.levels[low].pop()

    def expired(self, now: float | None = None) -> list[Pending]:
        """Remove and return every queued request that cannot be answered in time: its deadline
        has passed, or it would pass during the predicted compute of a batch of its own rows."""
        now = self.clock() if now is None else now
        return self.take_where(lambda p: self.due_at(p) <= now)

    def due_at(self, p: Pending) -> float:
        """When a queued request is due: its deadline less the predicted compute of its own rows."""
        return p.deadline - self.costs.predict(p.model, p.rows)

    def expired_heads(self, now: float) -> list[Pending]:
        """Like expired(), but only from the front of each level, where the earliest deadlines
        are when requests share a timeout: cheap enough to run on every pump (expired() covers
        the rest on the periodic sweep)."""
        out = []
        for q in self.queues.values():
            if q.count:
                for level in q.levels:
                    while level and self.due_at(level[0]) <= now:
                        out.append(level.popleft())
                        q.count -= 1
        return out

    def next_due(self) -> float | None:
        """When the first request at the front of a level becomes due for expired_heads()."""
        heads = [level[0] for q in self.queues.values() if q.count for level in q.levels if level]
        return min(map(self.due_at, heads), default=None)

    def take_all(self) -> list[Pending]:
        """Remove and return every queued request."""
        return self.take_where(lambda p: True)

    def take_where(self, condition: Callable[[Pending], bool]) -> list[Pending]:
        """Remove and return the queued requests that meet `condition`."""
        out = []
        for q in self.queues.values():
            for i, level in enumerate(q.levels):
                if any(condition(p) for p in level):
                    keep = deque()
                    for p in level:
                        (out if condition(p) else keep).append(p)
                    q.count -= len(level) - len(keep)
                    q.levels[i] = keep
        return out

    def models_with_work(self) -> list[str]:
        """Models with queued requests, rotated so each gets its turn first."""
        self._rr.rotate(-1)
        return [m for m in self._rr if self.queues[m].count]

    def head(self, model: str, now: float | None = None) -> Pending | None:
        """The request served next: the head of the level whose effective (aged) level is lowest."""
        q = self.queues[model]
        level = self._head_level(q, self.clock() if now is None else now)
        return None if level is None else q.levels[level][0]

    def _head_level(self, q: ModelQueue, now: float) -> int | None:
        step = q.aging_batches * self.costs.recent.get(q.name, 0.0)
        best, best_key = None, None
        for level, items in enumerate(q.levels):
            if not items:
                continue
            if step <= 0:  # no batch time yet: nothing ages
                return level
            p = items[0]
            effective = level if level == q.shadow_level else max(0, level - int((now - p.arrived) / step))
            key = (effective, p.arrived)  # at an equal level, the one that arrived first
            if best_key is None or key < best_key:
                best, best_key = level, key
        return best

    def hold_until(self, model: str, worker: int | None = None, now: float | None = None) -> float | None:
        """When the next batch should be dispatched if it is worth waiting to let it grow
        (max_delay_us); None: dispatch now. Never later than the first deadline among the
        requests it would carry minus the predicted compute of the batch it waits for."""
        q = self.queues[model]
        if not q.count:
            return None
        copies = q.levels[q.shadow_level]
        if copies and len(copies) == q.count:   # only shadow copies wait: go in full batches, each
            now = self.clock() if now is None else now   # batch's fixed cost paid by many copies
            until = copies[0].arrived + SHADOW_HOLD_S
            return None if len(copies) >= q.max_batch_size or until <= now else until
        if q.max_delay <= 0:
            return None
        now = self.clock() if now is None else now
        head = q.levels[self._head_level(q, now)][0]
        if head.alone:
            return None
        rows, first_deadline = 0, head.deadline
        for p in self._group(q, head):
            rows += p.rows
            first_deadline = min(first_deadline, p.deadline)
        goal = q.preferred[-1] if q.preferred else q.max_batch_size
        if rows >= goal or rows in q.preferred:
            return None
        grow_to = next((b for b in q.preferred if b > rows), q.max_batch_size)
        until = min(head.arrived + q.max_delay, first_deadline - self.costs.predict(model, grow_to, worker))
        return until if until > now else None

    def _group(self, q: ModelQueue, head: Pending) -> Iterator[Pending]:
        """Queued requests that could share the head's batch, level 0 first, up to a full batch."""
        group, rows, scanned = head.group(), 0, 0
        for level in q.levels:
            for p in level:
                if scanned >= self.SCAN_LIMIT or rows >= q.max_batch_size:
                    return
                scanned += 1
                if (p is head or not p.alone) and p.group() == group and rows + p.rows <= q.max_batch_size:
                    rows += p.rows
                    yield p

    def next_batch(self, model: str, max_bytes: int, max_out_bytes: int | None = None,
                   now: float | None = None, max_rows: int | None = None,
                   fits: Callable[[Pending, bool], bool] | None = None) -> list[Pending]:
        """Pop the head request and those of its group that fit; [] if the queue is empty.

        A batch holds one region per input of aligned size; `max_bytes` caps the whole batch so
        it fits the worker's input arena. Likewise `max_out_bytes` caps its outputs (one aligned
        region per declared output) to the output arena, when every request's output size is
        known: a batch whose outputs cannot fit would fail whole. A head that alone exceeds a
        cap is still returned: the caller answers it (admission normally stops it first). With
        preferred_batch_sizes, a batch that reaches one stops at the largest it can reach.
        `max_rows`: rows the worker takes at most (a generator's free slots), below max_batch_size.
        `fits(p, ok)`: shown every request scanned, the head first, in queue order, and whether it
        would be taken; says whether it is (a sequence model's: broker/sequence/binding.py). A head
        it refuses keeps its place, and the first request in queue order it takes leads the batch
        ([] when none)."""
        q = self.queues[model]
        if not q.count:
            return []
        level = self._head_level(q, self.clock() if now is None else now)
        head = q.levels[level].popleft()
        q.count -= 1
        if fits is not None and not fits(head, True):   # the first request the worker may run leads instead
            q.levels[level].appendleft(head)
            head = self._first_fitting(q, fits)
            if head is None:
                q.count += 1
                return []
        if head.alone:
            return [head]
        cap = q.max_batch_size if max_rows is None else max(1, min(q.max_batch_size, max_rows))
        if q.preferred and head.rows < q.preferred[-1]:
            avail = sum(p.rows for p in self._group(q, head)) + head.rows
            cap = max((b for b in q.preferred if b <= min(avail, cap)), default=cap)
        batch, rows = [head], head.rows
        # raw byte totals (None: an output size unknown until computed); regions padded to 64 bytes
        # exceed their raw sum by less than 64 each, so the exact layout is computed only near a cap
        raw, pad = head.in_total, ALIGN * len(head.nbytes)
        out_raw, out_pad = head.out_total, ALIGN * len(head.out_nbytes or ())
        group = head.group()
        scanned = 0
        for items in q.levels:
            skipped: list[Pending] = []
            while items and rows < cap and scanned < self.SCAN_LIMIT:
                p = items.popleft()
                scanned += 1
                ok = not (p.alone or p.group() != group or rows + p.rows > cap)
                if fits is not None:
                    ok = fits(p, ok)
                if not ok:
                    skipped.append(p)
                    continue
                raw_next = raw + p.in_total
                out_next = None if out_raw is None or p.out_total is None else out_raw + p.out_total
                if (raw_next + pad > max_bytes and _over(batch, p, "nbytes", max_bytes)) or \
                        (out_next is not None and max_out_bytes is not None and out_next + out_pad > max_out_bytes
                         and _over(batch, p, "out_nbytes", max_out_bytes)):
                    skipped.append(p)
                    scanned = self.SCAN_LIMIT  # the arena is full: stop looking in every level
                    break
                batch.append(p)
                rows, raw, out_raw = rows + p.rows, raw_next, out_next
            items.extendleft(reversed(skipped))  # skipped requests keep their place at the front
        q.count -= len(batch) - 1
        return batch

    def _first_fitting(self, q: ModelQueue, fits: Callable[[Pending, bool], bool]) -> Pending | None:
        """The first queued request (levels in order, up to SCAN_LIMIT) that `fits` takes, out of its
        queue; None when none (the queue's count is the caller's to keep)."""
        scanned = 0
        for items in q.levels:
            for p in items:
                if scanned >= self.SCAN_LIMIT:
                    return None
                scanned += 1
                if not p.alone and fits(p, True):
                    items.remove(p)
                    return p
        return None


def _over(batch: list[Pending], p: Pending, sizes: str, cap: int) -> bool:
    """Whether one block of the batch's regions (per input, or per output), grown by p's,
    overflows `cap`."""
    return aligned_total([sum(col) for col in zip(*(getattr(q, sizes) for q in batch), getattr(p, sizes))]) > cap
