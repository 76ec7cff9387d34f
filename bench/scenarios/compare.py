"""`tgw-bench compare`: the in-process floor, the transport floor, tgw (native, its HTTP face with
JSON and binary bodies, its gRPC face) and Flask + gunicorn on the same demo models, inputs and
closed-loop scenarios, in one invocation (harness/comparison.py); writes bench/results/ and a
RESULTS.md section. Exit status 0 when every row was filled, no request failed and the broker
stopped cleanly; 1 otherwise; 130 when interrupted.

    tgw-bench compare --quick                   # about 90 s: development runs
    tgw-bench compare                           # full mode, about 8 minutes: what bench/RESULTS.md quotes
    tgw-bench compare --models mlp --systems transport,tgw --duration 5
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time

from tgw.bench.harness import plots, report, subset
from tgw.bench.harness.comparison import MODES, SCENARIOS, collect
from tgw.testing.child import finish_run
from tgw.testing.demo import demo_models

NAME = "compare"
HELP = "in-process floor, transport floor, tgw, Flask+gunicorn side by side"


def add_arguments(cmp: argparse.ArgumentParser) -> None:
    cmp.add_argument("--quick", action="store_true", help="short runs (about 90 s in all) for development")
    cmp.add_argument("--duration", type=float, help="override: measured seconds per row")
    cmp.add_argument("--warmup", type=float, help="override: warm-up seconds per row")
    cmp.add_argument("--systems", default=list(report.SYSTEMS), type=subset(report.SYSTEMS),
                     help=f"comma-separated subset of {','.join(report.SYSTEMS)} (default: all)")
    models = tuple(dict.fromkeys(sc.model for sc in SCENARIOS))
    cmp.add_argument("--models", type=subset(models),
                     help=f"comma-separated subset of {','.join(models)} (default: all)")
    cores = os.cpu_count() or 1
    cmp.add_argument("--tgw-workers", type=int, default=cores, help=f"tgw cpu workers (default: cores = {cores})")
    cmp.add_argument("--flask-workers", type=int, default=cores, help="gunicorn sync workers (default: cores)")
    cmp.add_argument("--floor-procs", type=int, default=cores,
                     help="in-process floor: model copies, 1 torch thread each (default: cores)")
    cmp.add_argument("--floor-module", choices=("freeze", "none", "optimize"), default="freeze",
                     help="in-process floor: torch.jit.freeze as tgw's worker (default), as loaded, or frozen + "
                          "optimize_for_inference")
    cmp.add_argument("--out", help="folder for results/ and RESULTS.md (default: bench/ of the checkout, else .)")
    cmp.add_argument("--no-results-md", action="store_true", help="do not touch RESULTS.md")
    cmp.add_argument("--keep", action="store_true", help="keep the temporary folder (models, logs, sockets)")
    cmp.add_argument("--procs", type=int, default=0, help="generator processes (default: half the cores, 2..4)")


def run(a: argparse.Namespace) -> int:
    """The whole comparison; exit status 0 when every row was filled without a failed request and
    the broker stopped cleanly, 1 otherwise, 130 when interrupted."""
    base = MODES["quick" if a.quick else "full"]
    custom = (a.duration, a.warmup, a.models) != (None, None, None) or a.floor_module != "freeze" \
        or set(a.systems) != set(report.SYSTEMS)
    mode = "custom" if custom else ("quick" if a.quick else "full")
    a.duration = base["duration"] if a.duration is None else a.duration
    a.warmup = base["warmup"] if a.warmup is None else a.warmup
    a.floor_seconds, a.floor_rounds = base["floor_seconds"], base["floor_rounds"]
    scenarios = [sc for sc in SCENARIOS if not a.models or sc.model in a.models]
    log = lambda msg: print(f"[compare {time.strftime('%H:%M:%S')}] {msg}", flush=True)  # noqa: E731
    work = tempfile.mkdtemp(prefix="tgwb-", dir="/tmp")  # short: ipc paths must fit 107 bytes
    t0, date = time.monotonic(), datetime.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    try:
        log(f"{mode} mode: {a.duration:g} s per row after {a.warmup:g} s warm-up; work dir {work}")
        res = collect(a, work, demo_models(os.path.join(work, "models")), scenarios, log)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every server this run started", file=sys.stderr)
        return 130
    finally:
        finish_run(work, a.keep)
    settings = {k: getattr(a, k) for k in ("duration", "warmup", "floor_seconds", "floor_module", "tgw_workers",
                                           "flask_workers", "floor_procs", "procs", "systems")}
    settings["http_generator"] = res.get("http_generator", "-")
    result = {"mode": mode, "date": date, "command": a.command_line, "machine": report.machine(), "settings": settings,
              **res, "wall_s": time.monotonic() - t0}
    print("\n" + report.text_table(report.compare_table(result["scenarios"]), 3))
    print("\n" + report.text_table(report.cost_table(result["scenarios"]), 2))
    # --out, else bench/ of the checkout (run from its root, or an editable install), else .
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    dest = a.out or ("bench" if os.path.isfile("bench/cli.py") else
                     here if os.path.isfile(os.path.join(here, "RESULTS.md")) else ".")
    report.write_outputs(result, dest, results_md=not a.no_results_md, plot=plots.plot_compare)
    srv = result.get("tgw_server", {})
    complete = all("error" not in row and not row.get("requests_failed")
                   for sc in result["scenarios"] for row in sc["rows"].values())
    return 0 if complete and srv.get("exit_status", 0) == 0 and not srv.get("shm_leftovers") else 1
