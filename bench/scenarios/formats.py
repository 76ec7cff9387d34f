"""Model formats (issue 13): what each format buys. The demo `mlp` and `resnet`, the same weights
as TorchScript, a torch.export program and an AOTInductor package, served side by side by one
tgw broker (one cpu worker, one torch thread) and each driven closed-loop at c=1 and c=64; beside
each row, the in-process floor of that very program (the worker's own loader, one torch thread):
at c=1 batch-1 calls back to back, at c=64 calls at the model's max_batch_size (rows/s).

The floors run first, with no broker up, so nothing else competes for the cores. AOTInductor
rows need a C++ compiler to build the package; without one they are skipped, and the output says
so. A program that fails at 1 or max_batch_size rows (the sizes the broker warms it with) is left
out of the broker, its rows say why. The exit status is 1 when any row failed or saw an error.

    tgw-bench formats [--duration 5] [--warmup 1] [--floor-seconds 2] [--floor-rounds 2]
        [--models mlp,resnet] [--formats torchscript,export,aoti] [--models-dir DIR] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Optional

from tgw.bench.harness import subset
from tgw.bench.harness.baselines import run_floors
from tgw.bench.harness.loadgen import LoadSpec
from tgw.bench.harness.measure import measure
from tgw.bench.harness.report import FORMAT_LEVELS as LEVELS, formats_rows, formats_table
from tgw.bench.harness.targets import TgwTarget, make_inputs
from tgw.shm.model_format import FORMATS
from tgw.testing.child import BrokerProc

NAME = "formats"
HELP = "the demo models as torchscript, export and aoti, each beside its own in-process floor (own broker)"
BASES = ("mlp", "resnet", "embed")

# how save_model compiles AOTInductor packages (its comment says why)
AOTI_CONV_NOTE = "AOTInductor packages compiled from the loaded program with mkldnn and nnpack off (batch range 1..max)"


def build_and_check(out_dir: str, bases: list[str], formats: list[str]) -> dict[str, Any]:
    """Run in a subprocess by build(): it imports torch. Builds each file (cached in `out_dir`) and
    calls its program, loaded as the worker loads it, at 1 and max_batch_size rows: the sizes the
    broker warms it with, so a program that cannot serve the declaration is caught here."""
    import torch
    from tgw.workers.demo_models import DEMO_MODELS, build_file, cxx_compiler, demo_file
    from tgw.workers.formats import load_in_process
    got: dict[str, Any] = {"models": {}, "skipped": [], "refused": {}}
    for base in bases:
        for fmt in formats:
            name = f"{base}-{fmt}"
            if fmt == "aoti" and not os.path.exists(demo_file(out_dir, base, fmt)) and cxx_compiler() is None:
                got["skipped"].append(name)
                continue
            decl = {"path": build_file(out_dir, base, fmt), "format": fmt, "base": base, **DEMO_MODELS[base][2]}
            try:
                call = load_in_process(fmt, decl["path"]).call
                with torch.inference_mode():
                    for b in sorted({1, decl["max_batch_size"]}):
                        call(*[torch.from_numpy(x) for x in make_inputs(decl, b).values()])
            except Exception as exc:  # noqa: BLE001 - reported in its rows
                got["refused"][name] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
            got["models"][name] = decl
    return got


def build(out_dir: str, bases: list[str], formats: list[str]) -> dict[str, Any]:
    """build_and_check() in a subprocess, as tgw.testing.demo.demo_models builds: torch stays out of
    the harness and of the load generator's processes (spawned, they re-import this module).
    {"models": name (base-format) -> {path, format, base, inputs, outputs, max_batch_size},
    "skipped": names without a C++ compiler for AOTInductor, "refused": name -> what failed}."""
    os.makedirs(out_dir, exist_ok=True)
    code = ("import json, sys; from tgw.bench.scenarios.formats import build_and_check; "
            "print(json.dumps(build_and_check(sys.argv[1], sys.argv[2].split(','), sys.argv[3].split(','))))")
    proc = subprocess.run([sys.executable, "-c", code, out_dir, ",".join(bases), ",".join(formats)],
                          capture_output=True, text=True, timeout=1800)  # AOTI builds take 10-30 s each
    if proc.returncode != 0:
        raise RuntimeError(f"building the models failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def floors(models: dict[str, dict], seconds: float, rounds: int) -> dict[str, dict]:
    """name -> {c: floor}; c=1: batch-1 calls/s, c=64: rows/s at max_batch_size; or {"error"}.
    The best of `rounds` per batch size, the rounds taken over all models in turn, so that a
    noisy moment on a shared machine spoils one round of one model rather than its only one."""
    res: Optional[dict[str, Any]] = None
    for _ in range(rounds):
        res = run_floors(models, list(models), seconds, 1, lambda line: print(line, flush=True), previous=res,
                         module="served")
    out: dict[str, dict] = {}
    for name, r in (res or {}).items():
        if "error" in r:
            out[name] = r
            continue
        one, top = r["runs"][0], r["runs"][-1]   # sorted by batch size: 1 .. max_batch_size
        out[name] = {"loaded": r["module"], "torch": r["torch"], "rounds": r.get("rounds", 1),
                     "background_cpu_cores": r["background_cpu_cores"],
                     1: {"batch": 1, "rows_per_s": one["samples_per_s"], "p50_ms": one["latency_ms"]["p50"]},
                     64: {"batch": top["batch"], "rows_per_s": top["samples_per_s"], "p50_ms": top["latency_ms"]["p50"]}}
    return out


def broker_config(models: dict[str, dict]) -> dict[str, Any]:
    """One cpu worker, one torch thread, as the other rows; every model warmed at 1 and max rows."""
    return {"server": {"max_request_bytes": 64 << 20},
            "workers": {"devices": ["cpu"], "threads_per_worker": 1},
            "models": [{"name": n, "versions": [{"version": "1", "path": d["path"], "format": d["format"]}],
                        "inputs": d["inputs"], "outputs": d["outputs"], "max_batch_size": d["max_batch_size"],
                        "max_queue": 4096, "timeout_ms": 60000, "warmup_batch_sizes": [1, d["max_batch_size"]]}
                       for n, d in models.items()]}


def tgw_rows(broker: BrokerProc, models: dict[str, dict], duration: float, warmup: float) -> dict[str, dict]:
    """name -> {c: measure()'s summary, or {"error"}}."""
    from tgw.client import Client
    out: dict[str, dict] = {}
    with Client(broker.address) as client:
        processes = client.stats()["processes"]
        for name in models:
            out[name] = {}
            for c in LEVELS:
                spec = LoadSpec("closed", c, duration, warmup)
                try:
                    row = measure(TgwTarget(broker.address, name, timeout=60.0), spec, processes, stats=client.stats)
                except Exception as exc:  # noqa: BLE001 - record it, the other rows still run
                    row = {"error": f"{type(exc).__name__}: {exc}"}
                out[name][c] = row
                print(f"tgw {name} c={c}: " + (row["error"] if "error" in row else
                      f"{row['throughput_rps']:,.0f} req/s, p50 {row['latency_ms']['p50'] or 0:.3f} ms, "
                      f"errors {row['errors']}"), flush=True)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=5.0, help="measured seconds per tgw row (default 5)")
    p.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds per tgw row (default 1)")
    p.add_argument("--floor-seconds", type=float, default=2.0, help="seconds per floor batch size (default 2)")
    p.add_argument("--floor-rounds", type=int, default=2, help="floor rounds, the best kept (default 2)")
    p.add_argument("--models", type=subset(BASES), default=["mlp", "resnet"], help="demo models (default mlp,resnet)")
    p.add_argument("--formats", type=subset(FORMATS), default=list(FORMATS), help="default: all three")
    p.add_argument("--models-dir", help="build (or reuse) the model files here; default: a private folder, removed")
    p.add_argument("--json", help="write the rows here")


def run(a: argparse.Namespace) -> int:
    work = tempfile.mkdtemp(prefix="tgwf-", dir="/tmp")  # ipc paths must stay under 107 bytes
    broker = None
    try:
        built = build(a.models_dir or os.path.join(work, "models"), a.models, a.formats)
        models, skipped, refused = built["models"], built["skipped"], built["refused"]
        if "aoti" in a.formats:
            print(AOTI_CONV_NOTE, flush=True)
        if skipped:
            print(f"skipped {', '.join(skipped)}: no C++ compiler found ($CXX, c++, g++, clang++) to build the "
                  f"AOTInductor package", flush=True)
        for name, why in refused.items():  # the broker would refuse to start with it
            print(f"{name} left out: its program fails at 1 or max_batch_size rows: {why}", flush=True)
        served = {n: d for n, d in models.items() if n not in refused}
        floor = floors(served, a.floor_seconds, a.floor_rounds)
        tgw: dict[str, dict] = {}
        if served:
            broker = BrokerProc(broker_config(served), work).start(timeout=300)
            print(f"broker pid {broker.pid} at {broker.address}, 1 cpu worker, {len(served)} models", flush=True)
            tgw = tgw_rows(broker, served, a.duration, a.warmup)
        rows = formats_rows(models, tgw, floor, refused)
        print(formats_table(rows), flush=True)
        out = {"rows": rows, "skipped": skipped, "refused": refused,
               "aoti_build": AOTI_CONV_NOTE if "aoti" in a.formats else None,
               "duration_s": a.duration, "warmup_s": a.warmup, "floor_seconds": a.floor_seconds,
               "floor_rounds": a.floor_rounds, "torch": next((f["torch"] for f in floor.values() if "torch" in f), None),
               "floor": {n: {str(k): v for k, v in f.items()} for n, f in floor.items()},
               "tgw": {n: {str(c): r for c, r in by_c.items()} for n, by_c in tgw.items()}}
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1, default=str)
            print(f"wrote {a.json}")
        ok = all(not r.get("error") and r.get("requests", 0) > 0 and not r.get("errors") for r in rows)
        return 0 if ok else 1
    finally:
        if broker is not None:
            broker.stop()
        shutil.rmtree(work, ignore_errors=True)
