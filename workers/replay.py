"""Replay warm-up (docs/OPERATIONS.md#warm-up): a version loaded while its model serves runs the
model's recent batches - every shape seen, at the batch sizes seen - round after round before
the broker routes traffic to it, so the first calls at each shape (a TorchScript profiling
run, a kernel autotune, a lazy allocation) are paid here and not by callers.

A round runs each replayed batch once (zeros, or the callers' own bytes when the broker kept
them), timing its compute as a batch is served (ModelRunner.run: on a GPU, until its outputs
are on the host). The replay stops once two consecutive rounds' p99 agree (`settled`), or when
`max_s` has passed (the version is ready all the same; the report says so). A batch that
raises is left out of later rounds - real traffic met the same error - except a sticky CUDA
error, which fails the load.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Callable

import torch

from tgw.shm.wire import Replay, ReplayBatch, ReplayReport

from .cuda_faults import sticky_kind
from .runner import TORCH_DTYPES, ModelRunner

log = logging.getLogger("tgw.worker")
SETTLE = 0.2        # two rounds settle when the larger p99 is within 20 % of the smaller ...
SLACK_MS = 1.0      # ... or within this: sub-millisecond batches jitter more than 20 % by scheduling alone
FAILED_KEPT = 8     # errors a report lists


def p99(times: list[float]) -> float:
    """The nearest-rank 99th percentile: with 100 times or fewer, the largest."""
    ordered = sorted(times)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def settled(before_ms: float, now_ms: float, settle: float = SETTLE, slack_ms: float = SLACK_MS) -> bool:
    """Whether two consecutive rounds' p99 agree: the larger within `settle` of the smaller, or
    the two within `slack_ms` of each other."""
    high, low = max(before_ms, now_ms), min(before_ms, now_ms)
    return high <= low * (1 + settle) or high - low <= slack_ms


def batch_inputs(runner: ModelRunner, batch: ReplayBatch) -> list[torch.Tensor]:
    """The batch's inputs: the callers' bytes when it carries them, else zeros (on the device)."""
    out = []
    for k, (decl, shape) in enumerate(zip(runner.spec.inputs, batch.shapes)):
        dtype, full = TORCH_DTYPES[decl.dtype], [batch.rows, *shape]
        if batch.payload and batch.payload[k]:   # a copy: frombuffer needs a writable buffer
            out.append(torch.frombuffer(bytearray(batch.payload[k]), dtype=dtype).reshape(full))
        else:
            out.append(torch.zeros(full, dtype=dtype, device=runner.device))
    return out


def warm_replay(runner: ModelRunner, plan: Replay, clock: Callable[[], float] = time.perf_counter) -> ReplayReport:
    """Run `plan` on `runner` until its compute p99 settles or plan.max_s has passed."""
    report = ReplayReport(payloads=any(b.payload for b in plan.batches))
    start = clock()
    deadline = start + plan.max_s
    live, ran = list(plan.batches), set()   # ran: the ids of batches that computed at least once
    while live and not report.settled:
        times, whole = _round(runner, live, ran, report, deadline, clock)
        if times:
            report.rounds += 1
            report.p99_ms.append(round(p99(times) * 1000, 3))
        if not whole:   # max_s ran out within the round
            break
        report.settled = len(report.p99_ms) >= 2 and settled(report.p99_ms[-2], report.p99_ms[-1])
    report.seconds = round(clock() - start, 3)
    report.covered = [ReplayBatch(rows=b.rows, shapes=b.shapes) for b in plan.batches if id(b) in ran]
    if not report.settled:
        why = f"warmup.max_s {plan.max_s:g} ran out" if live else "every replayed batch raised"
        log.warning("%s: replay warm-up not settled after %d round(s) in %.1f s (%s); p99 ms per round %s: "
                    "ready all the same", runner.key, report.rounds, report.seconds, why, report.p99_ms)
    return report


def _round(runner: ModelRunner, live: list[ReplayBatch], ran: set, report: ReplayReport, deadline: float,
           clock: Callable[[], float]) -> tuple[list[float], bool]:
    """Each live batch once: (their compute seconds, whether the round ran to its end)."""
    times = []
    for batch in list(live):
        if clock() >= deadline:
            return times, False
        try:
            inputs = batch_inputs(runner, batch)
            t0 = clock()
            runner.run(inputs, batch.rows)
        except Exception as exc:
            if sticky_kind(exc):
                raise
            live.remove(batch)
            if len(report.failed) < FAILED_KEPT:
                report.failed.append(f"{batch.rows} x {batch.shapes}: {type(exc).__name__}: {exc}"[:300])
            continue
        times.append(clock() - t0)
        ran.add(id(batch))
    return times, True
