"""Replay warm-up's sample: each model's recent real batches, so a version loaded while the
model serves is warmed with what it will be asked (docs/OPERATIONS.md#warm-up; the worker's
side is workers/replay.py).

The core calls `record` as each batch goes to a worker: per model, each distinct (shape, batch
rows) seen, newest kept, at most `warmup.samples` of them - a dict lookup per batch, nothing per
request. With `warmup.replay_payloads` the bytes of the first batch of each are kept too, within
`warmup.payload_mb` per model: the callers' own data then stays in the broker's memory and goes
to every worker that loads a new version of the model - a privacy choice, off by default.
The recorder is the one writer of the sample; placement reads it as it sends a load (`replay`).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

from tgw.shm.wire import Replay, ReplayBatch

from tgw.broker.config.load import WarmupDecl
from tgw.broker.state.pending import plain_dims
from .entry import ModelEntry


class Sample:
    """One model's recent batches: (shape_key, rows) -> its inputs' bytes (None: shapes only)."""
    __slots__ = ("seen", "payload_bytes")

    def __init__(self):
        self.seen: OrderedDict[tuple, list[bytes] | None] = OrderedDict()   # oldest first
        self.payload_bytes = 0


class ReplayRecorder:
    def __init__(self, decl: WarmupDecl):
        self.samples: dict[str, Sample] = {}
        self.configure(decl)

    def configure(self, decl: WarmupDecl, models: Iterable[str] | None = None) -> None:
        """Take (new) settings: what they no longer allow goes at once (payloads, samples past the
        bound), and so do the samples of models not in `models`, when given (a reload removed them)."""
        self.decl, self.payload_limit = decl, decl.payload_mb << 20
        keep = None if models is None else set(models)
        for name, sample in list(self.samples.items()):
            if not decl.replay or (keep is not None and name not in keep):
                del self.samples[name]
                continue
            if not decl.replay_payloads:
                sample.seen = OrderedDict.fromkeys(sample.seen)
                sample.payload_bytes = 0
            while len(sample.seen) > decl.samples or sample.payload_bytes > self.payload_limit:
                self._drop_oldest(sample)

    def record(self, entry: ModelEntry, batch: list) -> None:
        """A batch of `entry` (its Pending requests) went to a worker: note its shape and rows."""
        decl = self.decl
        if not decl.replay:
            return
        first, rows = batch[0], 0
        for p in batch:
            rows += p.rows
        key = (first.shape_key if first.cuda is None else plain_dims(first.shape_key), rows)
        sample = self.samples.get(entry.name)
        if sample is None:
            if entry.decl.is_stage:   # a stage warms up by its own code, not by replay
                return
            sample = self.samples[entry.name] = Sample()
        seen = sample.seen
        if key in seen:
            seen.move_to_end(key)
            if decl.replay_payloads and seen[key] is None:   # the budget may have room again
                self._keep_payload(sample, key, batch)
            return
        seen[key] = None
        if decl.replay_payloads:
            self._keep_payload(sample, key, batch)
        if len(seen) > decl.samples:
            self._drop_oldest(sample)

    def _keep_payload(self, sample: Sample, key: tuple, batch: list) -> None:
        nbytes = sum(p.in_total for p in batch)
        if sample.payload_bytes + nbytes > self.payload_limit or any(p.cuda is not None for p in batch):
            return   # over the budget, or CUDA tensors the broker never held
        sample.seen[key] = [b"".join([p.tensors[k] for p in batch]) for k in range(len(batch[0].tensors))]
        sample.payload_bytes += nbytes

    @staticmethod
    def _drop_oldest(sample: Sample) -> None:
        _, payload = sample.seen.popitem(last=False)
        sample.payload_bytes -= sum(map(len, payload or ()))

    def replay(self, entry: ModelEntry) -> Replay | None:
        """What a version of `entry` loading now warms up with: its sample, newest first (None:
        replay off, or no batch of it seen yet)."""
        sample = self.samples.get(entry.name)
        if not self.decl.replay or sample is None or not sample.seen:
            return None
        declared = [list(t.shape) for t in entry.inputs]
        return Replay(max_s=self.decl.max_s, batches=[
            ReplayBatch(rows=rows, shapes=[list(d) for d in shapes] if shapes else declared, payload=payload or [])
            for (shapes, rows), payload in reversed(sample.seen.items())])

    def as_dict(self, model: str) -> dict:
        """For status: how many (shape, rows) the model's sample holds, and its payload bytes."""
        sample = self.samples.get(model)
        return {"samples": len(sample.seen) if sample else 0, "payload_bytes": sample.payload_bytes if sample else 0}


def summary(report: dict) -> str:
    """A replay warm-up's report (ReplayReport as builtins) in words, for log lines and the CLI."""
    p99 = " -> ".join(f"{ms:g}" for ms in report.get("p99_ms", []))
    covered = report.get("covered", [])
    how = "settled" if report.get("settled") else "not settled within warmup.max_s"
    failed = f", {len(report['failed'])} batch(es) failed" if report.get("failed") else ""
    return (f"replay warm-up: {report.get('rounds', 0)} round(s) of {len(covered)} batch(es)"
            f"{' with their payloads' if report.get('payloads') else ''}, p99 {p99 or '-'} ms, {how} "
            f"in {report.get('seconds', 0):.2f} s{failed}")
