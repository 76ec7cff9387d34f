"""`tgw-bench sequences`: a sequence model (Triton's sequence batching, implicit state) at 64
concurrent sequences of 100 steps over the native client, each sequence's steps one after
another, against the same TorchScript file served as a plain model whose caller feeds the state
back as an input (identical compute and batch sizes; bench/harness/seq_drive.py): steps/s (each
row's best round) and their ratio (the median of the rounds' ratios; the issue's goal: >= 0.8x), step latency p50/p99, and the broker's count of steps routed to
a worker that did not hold their sequence (goal: 0). Two workers, so routing matters.
Writes bench/results/sequences-<date>[-quick].json. Exit status 0 when every sequence ran every
step and matched the in-process run, 1 otherwise.

    tgw-bench sequences --quick           # a tiny model, 16 sequences of 10 steps: seconds, for the test
    tgw-bench sequences                   # the full run bench/results/sequences-*.json holds
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from typing import Any, Optional

import numpy as np

from tgw.bench.harness import report, seq_drive
from tgw.testing.child import BrokerProc, exit_record, finish_run

NAME = "sequences"
HELP = "a sequence model's steps/s at 64 sequences x 100 steps against the same model's one-shot requests"
SEQ, PLAIN = "rnn-seq", "rnn-plain"
TARGET = 0.8


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="a tiny model, 16 sequences of 10 steps (seconds)")
    p.add_argument("--sequences", type=int, default=None, help="concurrent sequences (default 64, quick 16)")
    p.add_argument("--steps", type=int, default=None, help="steps per sequence (default 100, quick 10)")
    p.add_argument("--rounds", type=int, default=None, help="rounds of both rows, each row's best kept (default 5, "
                                                             "quick 1)")
    p.add_argument("--workers", type=int, default=2, help="tgw CPU workers, one torch thread each (default 2)")
    p.add_argument("--seed", type=int, default=1, help="weights and inputs (default 1)")
    p.add_argument("--out", help="folder for results/ (default: bench/ of the checkout, else .)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder (model, logs, sockets)")


def sequence_counters(status: dict[str, Any], model: str) -> Optional[dict[str, Any]]:
    """The broker's counters of a sequence model (status, model `sequences`: live, started,
    ended, steps, misrouted - the steps dispatched to a worker that did not hold their sequence)."""
    return (status.get("models", {}).get(model) or {}).get("sequences")


def batches(address: str, model: str) -> tuple[int, int]:
    """The model's batches and rows so far (the broker's stats)."""
    from tgw.client import Client
    with Client(address) as c:
        m = c.stats()["models"].get(model) or {}
    return m.get("batches", 0), m.get("rows", 0)


def _f(v: Optional[float], fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def run(a: argparse.Namespace) -> int:
    sequences = a.sequences or (16 if a.quick else 64)
    steps = a.steps or (10 if a.quick else 100)
    rounds = a.rounds or (1 if a.quick else 5)
    if min(sequences, steps, rounds, a.workers) < 1:
        print("--sequences, --steps, --rounds and --workers must be at least 1", file=sys.stderr)
        return 2
    d, h = (seq_drive.QUICK_D, seq_drive.QUICK_H) if a.quick else (seq_drive.D, seq_drive.H)
    log = lambda msg: print(f"[sequences {time.strftime('%H:%M:%S')}] {msg}", flush=True)  # noqa: E731
    custom = (a.sequences, a.steps, a.rounds) != (None, None, None) or a.workers != 2
    mode = "custom" if custom else ("quick" if a.quick else "full")
    work = tempfile.mkdtemp(prefix="tgwq-", dir="/tmp")
    t0, date = time.monotonic(), datetime.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    res: dict[str, Any] = {"scenario": NAME, "mode": mode, "date": date, "command": a.command_line,
                           "machine": report.machine(), "rows": {"sequence": {}, "oneshot": {}}}
    broker = None
    try:
        path = seq_drive.save_model(os.path.join(work, "rnn.pt"), d, h, a.seed)
        xs = seq_drive.inputs(sequences, steps, d, a.seed)
        expected = seq_drive.reference(path, xs, h)
        res["settings"] = {
            "model": f"TorchScript GRUCell({d}, {h}) + Linear({h}, {d}): forward(INPUT, INPUT_STATE) -> "
                     "(OUTPUT, OUTPUT_STATE), written for Triton's PyTorch backend",
            "sequences": sequences, "steps_per_sequence": steps, "rounds": rounds, "workers": a.workers,
            "torch_threads_per_worker": 1,
            "sequence": f"{SEQ}: sequence_batching, implicit state INPUT_STATE -> OUTPUT_STATE kept in the worker's "
                        "slot; each step sends INPUT with sequence_id/start/end",
            "oneshot": f"{PLAIN}: the same file without sequence_batching; each step sends INPUT and the state the "
                       "previous step returned and gets OUTPUT and OUTPUT_STATE back (the fair baseline: the same "
                       "compute, the same closed loop, so the same batch sizes; it pays the state's bytes both ways)",
            "driver": "one AsyncClient, a task per sequence, each step sent when the previous one answered",
            "check": "each sequence's last OUTPUT against an in-process run of its steps (rtol 1e-3)"}
        cfg = {"workers": {"devices": ["cpu"] * a.workers, "threads_per_worker": 1},
               "models": seq_drive.entries(SEQ, PLAIN, path, d, h, sequences)}
        broker = BrokerProc(cfg, work).start(timeout=300)
        from tgw.client import Client
        log(f"{mode} mode: {sequences} sequences x {steps} steps, model {d}/{h}, {a.workers} workers")
        seq_drive.run_sequences(broker.address, PLAIN, xs[:2, :2], h, False, expected[:2])   # warm-up
        first_id = 1
        for r in range(rounds):
            for row, model, stateful in (("sequence", SEQ, True), ("oneshot", PLAIN, False)):
                before = batches(broker.address, model)
                new = seq_drive.run_sequences(broker.address, model, xs, h, stateful, expected, first_id)
                after = batches(broker.address, model)
                new["batches"] = after[0] - before[0]   # the batch sizes the broker formed for this row
                new["mean_batch_rows"] = (after[1] - before[1]) / new["batches"] if new["batches"] else None
                first_id += sequences   # fresh ids each round
                old = res["rows"][row]
                kept = new if not old or (new["steps_per_s"] or 0) > (old["steps_per_s"] or 0) else old
                res["rows"][row] = {**kept, "rounds": old.get("rounds", []) + [new["steps_per_s"]]}
                log(f"round {r + 1} {row}: {_f(new['steps_per_s'], ',.0f')} steps/s, mean batch "
                    f"{_f(new['mean_batch_rows'], '.1f')} rows, step p50 "
                    f"{_f(new['step_ms']['p50'], '.2f')} ms p99 {_f(new['step_ms']['p99'], '.2f')} ms"
                    + (f", {new['sequences_failed']} failed, e.g. {next(iter(new['errors']))}"
                       if new["sequences_failed"] else "")
                    + (f", {new['sequences_wrong']} WRONG" if new["sequences_wrong"] else ""))
        with Client(broker.address) as c:
            st = c.status()
        res["broker_sequences"] = counters = sequence_counters(st, SEQ)
        res["misrouted_steps"] = (counters or {}).get("misrouted")
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every server this run started", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - recorded
        res["error"] = f"{type(exc).__name__}: {exc}"
        log(f"FAILED: {res['error']}")
    finally:
        if broker is not None:
            res["server"] = exit_record(broker)
        finish_run(work, a.keep)
    # the median of the rounds' ratios: in a round the two rows run back to back, so each ratio
    # pairs rows the shared box's load met alike
    pairs = [a / b for a, b in zip(res["rows"]["sequence"].get("rounds", []), res["rows"]["oneshot"].get("rounds", []))
             if a and b]
    ratio = float(np.median(pairs)) if pairs else None
    res["ratio_per_round"] = pairs
    mis = res.get("misrouted_steps")
    res["goals"] = [
        {"goal": f"steps/s at {sequences} sequences, sequence model / one-shot (median of the rounds' ratios)",
         "value": ratio, "target": TARGET,
         "unit": "x", "met": None if ratio is None else ratio >= TARGET},
        {"goal": "steps routed to a worker that did not hold the sequence", "value": mis, "target": 0,
         "unit": "steps", "met": None if mis is None else mis == 0}]
    body = [["row", "steps/s", "mean batch", "step p50 ms", "step p99 ms", "failed", "wrong"]]
    for row, r in res["rows"].items():
        body.append([row, _f(r.get("steps_per_s"), ",.0f"), _f(r.get("mean_batch_rows"), ".1f"),
                     _f((r.get("step_ms") or {}).get("p50"), ".2f"),
                     _f((r.get("step_ms") or {}).get("p99"), ".2f"), str(r.get("sequences_failed", "-")),
                     str(r.get("sequences_wrong", "-"))])
    g = [["goal", "value", "target", "met"]] + [[x["goal"], _f(x["value"], ".2f" if x["unit"] == "x" else "d"),
                                                 str(x["target"]),
                                                 {True: "yes", False: "NO", None: "-"}[x["met"]]] for x in res["goals"]]
    report.conclude(res, "sequences", a.out, date, mode, t0, report.text_table(body) + "\n\n" + report.text_table(g))
    complete = "error" not in res and all(
        r.get("sequences_failed") == 0 and r.get("sequences_wrong") == 0 and r.get("sequences_checked") == sequences
        for r in res["rows"].values())
    return 0 if complete else 1
