"""How a shadow version's outputs differ from the serving version's, per output, accumulated
over the requests compared (docs/ROLLOUT.md). Pure numpy over two copies of a request's rows.

* float outputs: the largest |difference| of any element (max_abs) and, per request, that over
  the largest |serving value| (max_rel); a NaN on one side only is an infinite difference;
* score outputs (float, two or more dims, at least two classes in the last): the share of rows
  whose top class agrees (top1), and the mean overlap of their top-k sets (k = min(5, classes));
* integer, bool and bytes outputs: the share of rows that are exactly equal.
A shape or dtype that differs counts every row as disagreeing and the difference as infinite.
"""
from __future__ import annotations

import numpy as np

from tgw.shm.wire import BYTES

TOP_K = 5
INF = float("inf")


def as_array(dtype: str, shape: list[int], raw) -> np.ndarray:
    """A copy's bytes as an array (bfloat16, which numpy lacks, widened to float32)."""
    if dtype == "bfloat16":
        wide = np.frombuffer(raw, np.uint16).astype(np.uint32) << 16
        return wide.view(np.float32).reshape(shape)
    return np.frombuffer(raw, np.dtype(dtype)).reshape(shape)


class OutputDiff:
    """One output's comparison, over every request compared so far."""
    __slots__ = ("name", "requests", "rows", "max_abs", "max_rel", "scored_rows", "top1_agree", "topk_overlap",
                 "exact_rows", "equal_rows")

    def __init__(self, name: str):
        self.name = name
        self.requests = self.rows = 0
        self.max_abs = self.max_rel = 0.0
        self.scored_rows, self.top1_agree, self.topk_overlap = 0, 0, 0.0   # score outputs' rows
        self.exact_rows, self.equal_rows = 0, 0                              # exact outputs' rows

    def add(self, serving: tuple, shadow: tuple) -> None:
        """One request's rows: each side (dtype, shape, raw bytes)."""
        (dtype, shape, raw), (dtype2, shape2, raw2) = serving, shadow
        rows = shape[0] if shape else 1
        self.requests += 1
        self.rows += rows
        same = dtype == dtype2 and list(shape) == list(shape2)
        if dtype == BYTES or not same:
            self._exact(rows, same and bytes(raw) == bytes(raw2), infinite=not same)
            return
        a, b = as_array(dtype, shape, raw), as_array(dtype2, shape2, raw2)
        if a.dtype.kind not in "fc":   # bfloat16 arrives as float32
            equal = (a == b).reshape(rows, -1).all(axis=1) if a.size else np.ones(rows, bool)
            self.exact_rows += rows
            self.equal_rows += int(equal.sum())
            return
        self._distance(a.astype(np.float64), b.astype(np.float64))
        if a.ndim >= 2 and a.shape[-1] >= 2:
            self._scores(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]))

    def _exact(self, rows: int, equal: bool, infinite: bool) -> None:
        self.exact_rows += rows
        self.equal_rows += rows if equal else 0
        if infinite:
            self.max_abs = self.max_rel = INF

    def _distance(self, a: np.ndarray, b: np.ndarray) -> None:
        if not a.size:
            return
        diff = np.abs(a - b)
        one_nan = np.isnan(a) != np.isnan(b)
        diff = np.where(np.isnan(a) & np.isnan(b), 0.0, np.where(one_nan, INF, diff))
        worst = float(diff.max())
        scale = float(np.nanmax(np.abs(a))) if not np.isnan(a).all() else 0.0
        self.max_abs = max(self.max_abs, worst)
        self.max_rel = max(self.max_rel, worst / scale if scale > 0 else (0.0 if worst == 0 else INF))

    def _scores(self, a: np.ndarray, b: np.ndarray) -> None:
        k = min(TOP_K, a.shape[1])
        self.scored_rows += a.shape[0]
        self.top1_agree += int((a.argmax(axis=1) == b.argmax(axis=1)).sum())
        top_a, top_b = np.argsort(-a, axis=1)[:, :k], np.argsort(-b, axis=1)[:, :k]
        self.topk_overlap += float((top_a[:, :, None] == top_b[:, None, :]).any(axis=2).sum() / k)

    def summary(self) -> dict:
        out = {"requests": self.requests, "rows": self.rows}
        if self.scored_rows or self.exact_rows < self.rows:
            out.update(max_abs_diff=self.max_abs, max_rel_error=self.max_rel)
        if self.scored_rows:
            out.update(top1_agreement=self.top1_agree / self.scored_rows,
                       topk_agreement=self.topk_overlap / self.scored_rows, top_k=TOP_K)
        if self.exact_rows:
            out.update(exact_agreement=self.equal_rows / self.exact_rows)
        return out


def worst(diffs: dict[str, OutputDiff]) -> dict:
    """The figures a policy judges, over every output: the largest differences, the lowest
    agreements (None: no output has that kind)."""
    scored = [d for d in diffs.values() if d.scored_rows]
    exact = [d for d in diffs.values() if d.exact_rows]
    measured = [d for d in diffs.values() if d.exact_rows < d.rows or d.max_abs == INF]
    return {"max_abs_diff": max((d.max_abs for d in measured), default=None),
            "max_rel_error": max((d.max_rel for d in measured), default=None),
            "top1_agreement": min((d.top1_agree / d.scored_rows for d in scored), default=None),
            "exact_agreement": min((d.equal_rows / d.exact_rows for d in exact), default=None)}
