"""`tgw-bench onnx`: an ONNX model served by tgw against onnxruntime's own in-process floor, and
against the same model as TorchScript in tgw. The demo resnet (float32 [3, 64, 64] -> 1000
logits) is exported with `torch.onnx.export(..., dynamo=True)` and saved as TorchScript from the
same weights. The floor is onnxruntime in process, one thread, swept over batches of 1..64 rows,
each batch the better of its plain API (`InferenceSession.run` on numpy arrays) and the worker's
own call (`load_in_process("onnx", path)`, I/O binding), its best rows/s kept; tgw serves both files
from one cpu worker (one thread, max_batch_size 64) and each is driven closed-loop at c=64. The
issue's goal: tgw's ONNX rows/s at c=64 >= 0.9x the floor's best. Also each side's CPU per row
(the floor's least over batches; the worker's during tgw's row), which the box's other load
does not move. Each round runs the floor
sweep (the broker up and idle), then tgw's ONNX row, then its TorchScript row, back to back: the
ratios are the median over rounds of each round's ratio to its own floor (a shared box's load
moves between rounds); the table shows each row's best round. tgw's ONNX answer to
one image is checked against onnxruntime's own. Writes bench/results/onnx-<date>[-quick].json.
Exit status 0 when every row ran without errors and the answer matched, 1 otherwise.

    tgw-bench onnx --quick        # two floor batches, 1 s rows, one round: seconds, for the test
    tgw-bench onnx                # the full run bench/results/onnx-*.json holds
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

import numpy as np

from tgw.bench.harness import report
from tgw.bench.harness.loadgen import LoadSpec
from tgw.bench.harness.measure import measure
from tgw.bench.harness.targets import TgwTarget
from tgw.testing.child import BrokerProc, exit_record, finish_run

NAME = "onnx"
HELP = "the demo resnet as ONNX in tgw at c=64 against onnxruntime's own floor, and as TorchScript in tgw"
TARGET = 0.9
MAX_BATCH = 64
FULL_BATCHES = (1, 2, 4, 8, 16, 32, 64)
QUICK_BATCHES = (1, 8)
ROWS = {"onnx": "resnet-onnx", "torchscript": "resnet-ts"}
SHAPE = [3, 64, 64]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="floor batches 1 and 8, 1 s rows, one round (seconds)")
    p.add_argument("--concurrency", type=int, default=64, help="closed-loop callers per tgw row (default 64)")
    p.add_argument("--duration", type=float, default=None, help="measured seconds per tgw row (default 10, quick 1)")
    p.add_argument("--floor-seconds", type=float, default=None, help="seconds per floor batch and kind (default 1.5, quick 0.2)")
    p.add_argument("--rounds", type=int, default=None, help="rounds of the floor and the tgw rows "
                                                            "(default 5, quick 1)")
    p.add_argument("--out", help="folder for results/ (default: bench/ of the checkout, else .)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder (models, logs, sockets)")


def build(folder: str) -> dict[str, str]:
    """The demo resnet as ONNX and TorchScript (the same weights), built in a subprocess: torch
    stays out of the harness and of the load generator's processes."""
    code = ("import json, sys; from tgw.workers.demo_models import build_file; "
            "print(json.dumps({f: build_file(sys.argv[1], 'resnet', f) for f in ('onnx', 'torchscript')}))")
    proc = subprocess.run([sys.executable, "-c", code, folder], capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"building the models failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _timed(call, seconds: float) -> dict[str, float]:
    end = time.perf_counter() + min(1.0, seconds / 2)
    while time.perf_counter() < end:
        call()
    lat, t0, cpu0 = [], time.perf_counter(), time.process_time()
    while len(lat) < 5 or time.perf_counter() < t0 + seconds:
        t1 = time.perf_counter()
        call()
        lat.append(time.perf_counter() - t1)
    return {"calls": len(lat), "calls_per_s": len(lat) / (time.perf_counter() - t0),
            "cpu_us_per_call": (time.process_time() - cpu0) * 1e6 / len(lat),
            "p50_ms": float(np.percentile(np.array(lat) * 1e3, 50))}


def ort_floor(path: str, batches: list[int], seconds: float) -> dict[str, Any]:
    """The floor, in this process (run as a subprocess by floor()), one thread: per batch,
    onnxruntime's own `session.run` on numpy arrays, then the worker's call of the same file
    (`load_in_process("onnx", path)`: I/O binding over torch tensors); a batch's figure is the
    better of the two. Also onnxruntime's answer to image(0)."""
    import onnxruntime as ort
    import torch
    from tgw.workers.formats import load_in_process
    torch.set_num_threads(1)   # the worker's call takes its intra-op threads from torch
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = 1, 1
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    served = load_in_process("onnx", path).call
    name = session.get_inputs()[0].name
    runs = []
    for b in batches:
        x = np.random.default_rng(b).standard_normal((b, *SHAPE), dtype=np.float32)
        t = torch.from_numpy(x)
        own = _timed(lambda: session.run(None, {name: x}), seconds)
        call = _timed(lambda: served(t), seconds)
        top = max(own, call, key=lambda r: r["calls_per_s"])
        runs.append({"batch": b, "rows_per_s": top["calls_per_s"] * b, "p50_ms": top["p50_ms"],
                     "cpu_us_per_row": min(own["cpu_us_per_call"], call["cpu_us_per_call"]) / b,
                     "by": "session.run" if top is own else "load_in_process",
                     "session_run_rows_per_s": own["calls_per_s"] * b, "load_in_process_rows_per_s":
                     call["calls_per_s"] * b})
    answer = session.run(None, {name: image(0)})[0][0]
    return {"onnxruntime": ort.__version__, "runs": runs, "answer": answer.tolist()}


def floor(path: str, batches: list[int], seconds: float) -> dict[str, Any]:
    code = ("import json, sys; from tgw.bench.scenarios.onnx import ort_floor; "
            "print(json.dumps(ort_floor(sys.argv[1], [int(b) for b in sys.argv[2].split(',')], float(sys.argv[3]))))")
    proc = subprocess.run([sys.executable, "-c", code, path, ",".join(map(str, batches)), str(seconds)],
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"the onnxruntime floor failed:\n{proc.stderr[-3000:]}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    got["best"] = max(got["runs"], key=lambda r: r["rows_per_s"])
    return got


def best_runs(old: Optional[dict[str, Any]], new: dict[str, Any]) -> dict[str, Any]:
    """The floor over the rounds so far: per batch its best round; `best` the best of those."""
    runs = new["runs"] if old is None else [max(a, b, key=lambda r: r["rows_per_s"])
                                            for a, b in zip(old["runs"], new["runs"])]
    return {**new, "runs": runs, "best": max(runs, key=lambda r: r["rows_per_s"]),
            "rounds": (old or {}).get("rounds", 0) + 1}


def image(seed: int) -> np.ndarray:
    return np.random.default_rng(1000 + seed).standard_normal((1, *SHAPE), dtype=np.float32)


def broker_config(files: dict[str, str]) -> dict[str, Any]:
    return {"server": {"max_request_bytes": 64 << 20},
            "workers": {"devices": ["cpu"], "threads_per_worker": 1},
            "models": [{"name": ROWS[fmt], "versions": [{"version": "1", "path": path, "format": fmt}],
                        "inputs": [{"name": "image", "dtype": "float32", "shape": SHAPE}],
                        "outputs": [{"name": "logits", "dtype": "float32", "shape": [1000]}],
                        "max_batch_size": MAX_BATCH, "max_queue": 4096, "timeout_ms": 60000,
                        "warmup_batch_sizes": [1, MAX_BATCH]} for fmt, path in files.items()]}


def tgw_row(broker: BrokerProc, model: str, concurrency: int, duration: float) -> dict[str, Any]:
    from tgw.client import Client
    with Client(broker.address) as client:
        spec = LoadSpec("closed", concurrency, duration, min(2.0, duration / 3))
        row = measure(TgwTarget(broker.address, model, timeout=60.0), spec, client.stats()["processes"],
                      stats=client.stats)
    return {"rows_per_s": row["throughput_rps"], "p50_ms": row["latency_ms"]["p50"],
            "p99_ms": row["latency_ms"]["p99"], "requests": row.get("requests_ok"),
            "failed": row.get("requests_failed"), "errors": row.get("errors", {}),
            "mean_batch_rows": (row.get("broker_stats") or {}).get("mean_batch_rows"),
            "worker_cpu_us_per_row": (row.get("cpu_us_per_request") or {}).get("workers"),
            "broker_cpu_us_per_row": (row.get("cpu_us_per_request") or {}).get("broker"),
            "other_cpu_cores": (row.get("machine") or {}).get("other_cpu_cores"), "raw": row}


def _f(v: Optional[float], fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def run(a: argparse.Namespace) -> int:
    duration = a.duration or (1.0 if a.quick else 10.0)
    seconds = a.floor_seconds or (0.2 if a.quick else 1.5)
    rounds = a.rounds or (1 if a.quick else 5)
    batches = list(QUICK_BATCHES if a.quick else FULL_BATCHES)
    custom = (a.duration, a.floor_seconds, a.rounds) != (None, None, None) or a.concurrency != 64
    mode = "custom" if custom else ("quick" if a.quick else "full")
    log = lambda msg: print(f"[onnx {time.strftime('%H:%M:%S')}] {msg}", flush=True)  # noqa: E731
    work = tempfile.mkdtemp(prefix="tgwon-", dir="/tmp")
    t0, date = time.monotonic(), datetime.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    res: dict[str, Any] = {"scenario": NAME, "mode": mode, "date": date, "command": a.command_line,
                           "machine": report.machine(), "settings": {
                               "model": "the demo resnet (workers/demo_models.py SmallResNet), float32 [3, 64, 64] "
                                        "-> [1000]; ONNX by torch.onnx.export(dynamo=True, a dynamic batch dim), "
                                        "TorchScript by torch.jit.script, the same weights",
                               "floor": "per batch the better of onnxruntime's InferenceSession.run on numpy inputs "
                                        "(CPU execution provider, one intra-op thread, its defaults otherwise) and "
                                        "the worker's call (load_in_process('onnx'), I/O binding, one thread); "
                                        "batches " + str(batches),
                               "tgw": f"one cpu worker, one thread, max_batch_size {MAX_BATCH}, closed loop at "
                                      f"c={a.concurrency} over the native client, {duration} s per row, "
                                      f"{rounds} round(s), each the floor sweep then both tgw rows"},
                           "rows": {}}
    broker = None
    try:
        files = build(os.path.join(work, "models"))
        broker = BrokerProc(broker_config(files), work).start(timeout=300)
        from tgw.client import Client
        for r in range(rounds):
            # the floor and the tgw rows back to back: a round's ratio pairs figures the box's load met alike
            fl = floor(files["onnx"], batches, seconds)
            log(f"round {r + 1} floor: " + ", ".join(f"batch {x['batch']} {x['rows_per_s']:,.0f}" for x in fl["runs"])
                + " rows/s")
            res["floor"] = best_runs(res.get("floor"), fl)
            if r == 0:
                with Client(broker.address) as c:
                    served = c.infer(ROWS["onnx"], {"image": image(0)})["logits"][0]
                res["answer_max_abs_diff"] = float(np.max(np.abs(served - np.array(fl["answer"], np.float32))))
            for fmt, model in ROWS.items():
                new = tgw_row(broker, model, a.concurrency, duration)
                new["over_round_floor"] = new["rows_per_s"] / fl["best"]["rows_per_s"]
                old = res["rows"].get(fmt) or {}
                kept = new if not old or new["rows_per_s"] > old["rows_per_s"] else old
                res["rows"][fmt] = {**kept, "rounds": old.get("rounds", []) + [new["rows_per_s"]],
                                    "ratios": old.get("ratios", []) + [new["over_round_floor"]],
                                    "worker_cpu": old.get("worker_cpu", []) + [new["worker_cpu_us_per_row"]],
                                    "broker_cpu": old.get("broker_cpu", []) + [new["broker_cpu_us_per_row"]]}
                log(f"round {r + 1} tgw {fmt}: {new['rows_per_s']:,.0f} rows/s ({new['over_round_floor']:.2f}x the "
                    f"round's floor), mean batch {_f(new['mean_batch_rows'], '.1f')}, p50 {_f(new['p50_ms'], '.2f')} "
                    f"ms, worker CPU {_f(new['worker_cpu_us_per_row'], '.0f')} us/row, other load "
                    f"{_f(new['other_cpu_cores'], '.2f')} cores, errors {new['errors']}")
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
    best = (res.get("floor") or {}).get("best") or {}
    onnx_r, ts_r = res["rows"].get("onnx") or {}, res["rows"].get("torchscript") or {}
    ratio = float(np.median(onnx_r["ratios"])) if onnx_r else None
    res["goals"] = [{"goal": f"tgw ONNX rows/s at c={a.concurrency} / onnxruntime's floor at its best batch "
                             "(the median of the rounds' ratios, each to its own round's floor)", "value": ratio,
                     "target": TARGET, "unit": "x", "met": None if ratio is None else ratio >= TARGET}]
    res["best_over_best_floor"] = onnx_r["rows_per_s"] / best["rows_per_s"] if onnx_r and best else None
    # CPU per row, which the box's other load does not change: the floor's least at any batch over
    # the worker's own (its share of the ONNX row), each row's median over the rounds
    floor_cpu = min((r["cpu_us_per_row"] for r in (res.get("floor") or {}).get("runs", [])), default=None)
    worker_cpu = float(np.median(onnx_r["worker_cpu"])) if onnx_r.get("worker_cpu") else None
    res["cpu_per_row"] = {"floor_us": floor_cpu, "tgw_worker_us": worker_cpu,
                          "tgw_broker_us": float(np.median(onnx_r["broker_cpu"])) if onnx_r.get("broker_cpu") else None,
                          "floor_over_worker": floor_cpu / worker_cpu if floor_cpu and worker_cpu else None}
    pairs = [o / t for o, t in zip(onnx_r.get("rounds", []), ts_r.get("rounds", [])) if o and t]
    res["onnx_over_torchscript"] = float(np.median(pairs)) if pairs else None
    body = [["row (best round)", "rows/s", "mean batch", "p50 ms", "p99 ms", "x floor (median of rounds)"]]
    if best:
        body.append([f"floor (batch {best['batch']}, {best['by']})", _f(best["rows_per_s"], ",.0f"), str(best["batch"]),
                     _f(best["p50_ms"], ".2f"), "-", "1.00"])
    for fmt, r in res["rows"].items():
        body.append([f"tgw {fmt} c={a.concurrency}", _f(r["rows_per_s"], ",.0f"), _f(r["mean_batch_rows"], ".1f"),
                     _f(r["p50_ms"], ".2f"), _f(r["p99_ms"], ".2f"), _f(float(np.median(r["ratios"])), ".2f")])
    g = [["goal", "value", "target", "met"]] + [[x["goal"], _f(x["value"], ".2f"), str(x["target"]),
                                                 {True: "yes", False: "NO", None: "-"}[x["met"]]] for x in res["goals"]]
    g.append(["tgw ONNX / tgw TorchScript rows/s (median of the rounds' ratios)",
              _f(res["onnx_over_torchscript"], ".2f"), "reported", "-"])
    cpu = res["cpu_per_row"]
    g.append([f"CPU us per row: the floor's least {_f(cpu['floor_us'], '.0f')} / tgw's worker "
              f"{_f(cpu['tgw_worker_us'], '.0f')} (its broker {_f(cpu['tgw_broker_us'], '.0f')}; medians of the rounds)",
              _f(cpu["floor_over_worker"], ".2f"), "reported", "-"])
    g.append(["tgw's ONNX answer vs onnxruntime's, max abs diff", _f(res.get("answer_max_abs_diff"), ".2e"),
              "< 1e-4", "-"])
    report.conclude(res, "onnx", a.out, date, mode, t0, report.text_table(body) + "\n\n" + report.text_table(g))
    complete = ("error" not in res and len(res["rows"]) == len(ROWS)
                and all(not r["errors"] and not r["failed"] and r["requests"] for r in res["rows"].values())
                and res.get("answer_max_abs_diff", 1.0) < 1e-4)
    return 0 if complete else 1
