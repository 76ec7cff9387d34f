"""The online cost model: how long a batch of n rows of a model takes on a worker.

An EWMA of the `compute_us` every completion reports, per (model, worker, rows). Asked about a
batch size it has not seen on that worker, it answers from the nearest sizes it has seen there
(linear between two, proportional to rows above the largest: compute per row only falls as
batches grow, so both overestimate a little rather than promise too much), else from any
worker. The scheduler uses it to wait on purpose only while no deadline breaks, to answer at
once the requests no batch could finish in time, to time aging, and to stage a worker's next
batch just before the one computing ends (stage_ahead) rather than behind it.
"""
from __future__ import annotations

import bisect

ALPHA = 0.2  # weight of the newest sample: ~5 batches of memory, so a slower version shows quickly
# a worker's next batch is staged when the one computing is predicted to have this long left: late
# enough that the batch grows and a request of higher priority arriving meanwhile still makes it
STAGE_AHEAD_S, STAGE_AHEAD_SHARE = 0.002, 0.25   # at least 2 ms, or a quarter of a recent batch


class CostModel:
    def __init__(self) -> None:
        # model -> worker id -> rows -> EWMA seconds; plus per model one EWMA over all batches
        self.table: dict[str, dict[int, dict[int, float]]] = {}
        self._sizes: dict[tuple[str, int], list[int]] = {}   # sorted rows seen, per (model, worker)
        self.recent: dict[str, float] = {}                    # model -> EWMA batch seconds
        # model -> (most seconds, most seconds per row) any EWMA has held: predict() never exceeds
        # max(most, per_row x rows), so a deadline beyond that needs no prediction
        self._most: dict[str, tuple[float, float]] = {}

    def observe(self, model: str, worker: int, rows: int, compute_us: int) -> None:
        s = compute_us / 1e6
        per_worker = self.table.setdefault(model, {}).setdefault(worker, {})
        old = per_worker.get(rows)
        if old is None:
            per_worker[rows] = s
            bisect.insort(self._sizes.setdefault((model, worker), []), rows)
        else:
            per_worker[rows] = old + ALPHA * (s - old)
        r = self.recent.get(model)
        self.recent[model] = s if r is None else r + ALPHA * (s - r)
        t = per_worker[rows]
        most, per_row = self._most.get(model, (0.0, 0.0))
        if t > most or t / rows > per_row:
            self._most[model] = (max(most, t), max(per_row, t / rows))

    def bound_ms(self, model: str, rows: int) -> float:
        """An upper bound of predict(model, rows, any worker), in milliseconds."""
        most, per_row = self._most.get(model, (0.0, 0.0))
        return 1000.0 * max(most, per_row * rows)

    def predict(self, model: str, rows: int, worker: int | None = None) -> float:
        """Seconds a batch of `rows` is expected to compute (0.0 while nothing is known)."""
        workers = self.table.get(model)
        if not workers:
            return 0.0
        if worker not in workers:
            return max(self._on(model, w, rows) for w in workers)  # the slowest: a promise to keep
        return self._on(model, worker, rows)

    def _on(self, model: str, worker: int, rows: int) -> float:
        seen = self.table[model][worker]
        t = seen.get(rows)
        if t is not None:
            return t
        sizes = self._sizes[(model, worker)]
        i = bisect.bisect_left(sizes, rows)
        if i == len(sizes):                       # above every size seen: per-row cost of the largest
            big = sizes[-1]
            return seen[big] * rows / big
        if i == 0:                                # below every size seen: no faster than the smallest
            return seen[sizes[0]]
        lo, hi = sizes[i - 1], sizes[i]
        return seen[lo] + (seen[hi] - seen[lo]) * (rows - lo) / (hi - lo)

    def stage_ahead(self, model: str) -> float:
        """How long before a worker is predicted to be free its next batch should be staged."""
        return max(STAGE_AHEAD_S, STAGE_AHEAD_SHARE * self.recent.get(model, 0.0))

    def as_dict(self, model: str) -> dict:
        """For stats: {"worker N": {rows: µs}} and the recent batch time in µs."""
        out = {f"worker{w}": {str(r): round(t * 1e6, 1) for r, t in sorted(sizes.items())}
               for w, sizes in sorted(self.table.get(model, {}).items())}
        return {"compute_us": out, "recent_batch_us": round(self.recent.get(model, 0.0) * 1e6, 1)}
