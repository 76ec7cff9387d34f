"""Side-by-side comparison in one invocation: in-process floor, transport floor, tgw native and
Flask + gunicorn, on the same demo models, inputs and scenarios (see bench/README.md).

    python bench/compare.py --quick      # < 2 minutes, for development
    python bench/compare.py              # full mode, < 20 minutes; updates bench/RESULTS.md

Also `python -m tgw.bench.compare`. Writes bench/results/<date>.json and .png and replaces the
run's section of bench/RESULTS.md. Everything listens on Unix sockets or 127.0.0.1 only; every
server it starts is stopped by PID at the end, also on Ctrl-C, SIGTERM and errors. Exit status
0 when every row was filled without a failed request, 1 otherwise, 130 when interrupted.
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__" and not __package__:
    # Run as a script: drop bench/ from sys.path so its module names (report, procs, ...) cannot
    # shadow other packages, and import everything through the installed tgw.bench package.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    try:
        import tgw.bench  # noqa: F401
    except ImportError:
        sys.exit("tgw is not installed in this interpreter: run `pip install -e '.[server,bench]'` from "
                 "the repository root first (see bench/README.md)")

import argparse
import datetime
import shlex
import shutil
import tempfile
import time
from typing import Any

from tgw.bench import compare_report as out
from tgw.bench.compare_phases import Ctx, Servers, floor_rows, run_floors
from tgw.bench.compare_rows import SCENARIOS, SYSTEMS, format_text, scenario_result, table_rows
from tgw.bench.inputs import reply_bytes, request_bytes
from tgw.bench.procs import sigterm_as_interrupt, stop_all
from tgw.bench.report import write_json
from tgw.bench.tgw_server import build_demo_models

MODES = {  # seconds measured per row, warm-up per row, seconds per in-process floor batch size
    "quick": {"duration": 2.0, "warmup": 0.5, "floor_seconds": 0.5, "floor_rounds": 1},
    "full": {"duration": 15.0, "warmup": 3.0, "floor_seconds": 3.0, "floor_rounds": 2},
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--quick", action="store_true", help="short runs (< 2 minutes in all)")
    ap.add_argument("--duration", type=float, help="override: measured seconds per row")
    ap.add_argument("--warmup", type=float, help="override: warm-up seconds per row")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help=f"comma-separated subset of {','.join(SYSTEMS)} (default: all)")
    ap.add_argument("--models", help="comma-separated subset of the scenario models (mlp,resnet,resnet224)")
    cores = os.cpu_count() or 1
    ap.add_argument("--tgw-workers", type=int, default=cores, help=f"tgw cpu workers (default: cores = {cores})")
    ap.add_argument("--flask-workers", type=int, default=cores, help="gunicorn sync workers (default: cores)")
    ap.add_argument("--floor-procs", type=int, default=cores,
                    help="in-process floor: model copies, 1 torch thread each (default: cores)")
    ap.add_argument("--procs", type=int, default=0, help="load generator processes (default: loadgen's)")
    ap.add_argument("--out", help="folder for results/ and RESULTS.md (default: bench/ of the checkout)")
    ap.add_argument("--no-results-md", action="store_true", help="do not touch RESULTS.md")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder (models, logs, sockets)")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    a.systems = [s for s in a.systems.split(",") if s]
    unknown = set(a.systems) - set(SYSTEMS)
    if unknown:
        ap.error(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    return a


def _command(argv: list[str] | None) -> str:
    args = sys.argv[1:] if argv is None else argv
    if __name__ == "__main__" and not __package__:
        return "python bench/compare.py " + shlex.join(args) if args else "python bench/compare.py"
    return ("python -m tgw.bench.compare " + shlex.join(args)).strip()


def _out_dir(a: argparse.Namespace) -> str:
    if a.out:
        return a.out
    if os.path.isfile(os.path.join("bench", "compare.py")):
        return "bench"
    return os.path.dirname(os.path.abspath(__file__))


def collect(a: argparse.Namespace, ctx: Ctx, t0: float) -> dict[str, Any]:
    rows: dict[str, dict[str, Any]] = {sc.key: {} for sc in ctx.scenarios}
    extra: dict[str, Any] = {}
    payloads = {m: request_bytes(ctx.models[m]) for m in ctx.models}
    replies = {m: reply_bytes(ctx.models[m]) for m in ctx.models}
    floors = None
    if "in-process" in a.systems:
        ctx.log("in-process floor (TorchScript called directly)")
        floors = run_floors(ctx)
    servers = [s for s in a.systems if s != "in-process"]
    if servers:
        ctx.log(f"starting {', '.join(servers)} (tgw: {ctx.tgw_workers} cpu workers; gunicorn: "
                f"{ctx.flask_workers} sync workers)")
        with Servers(ctx, servers, payloads, replies) as srv:
            for sc in ctx.scenarios:
                srv.run_scenario(sc, rows)
        extra["tgw_server"], extra["flask_server"] = srv.info["tgw"], srv.info["flask"]
    if floors is not None and ctx.floor_rounds > 1:
        ctx.log("in-process floor again (the best of both rounds is kept)")
        floors = run_floors(ctx, floors)
    if floors is not None:
        floor_rows(ctx, floors, rows)
        extra["floors"] = floors
    return {"scenarios": [scenario_result(sc, payloads[sc.model], rows[sc.key]) for sc in ctx.scenarios],
            **extra, "wall_s": time.monotonic() - t0}


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    base = MODES["quick" if a.quick else "full"]
    custom = a.duration is not None or a.warmup is not None or a.models or set(a.systems) != set(SYSTEMS)
    mode = "custom" if custom else ("quick" if a.quick else "full")
    duration = a.duration if a.duration is not None else base["duration"]
    warmup = a.warmup if a.warmup is not None else base["warmup"]
    scenarios = [sc for sc in SCENARIOS if not a.models or sc.model in a.models.split(",")]
    if not scenarios:
        sys.exit(f"no scenario for models {a.models!r}")
    sigterm_as_interrupt()
    log = lambda msg: print(f"[compare {time.strftime('%H:%M:%S')}] {msg}", flush=True)  # noqa: E731
    work = tempfile.mkdtemp(prefix="tgwb-", dir="/tmp")  # short: ipc paths must fit 107 bytes
    t0 = time.monotonic()
    date = datetime.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    try:
        log(f"{mode} mode: {duration:g} s per row after {warmup:g} s warm-up; work dir {work}")
        models = build_demo_models(os.path.join(work, "models"))
        ctx = Ctx(work, models, scenarios, duration, warmup, base["floor_seconds"], base["floor_rounds"],
                  a.tgw_workers, a.flask_workers, a.floor_procs, a.procs,
                  False if a.no_progress else None, log)
        res = collect(a, ctx, t0)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every server this run started", file=sys.stderr)
        return 130
    finally:
        stop_all()
        if a.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    result = {"mode": mode, "date": date, "command": _command(argv), "machine": out.machine(),
              "settings": {"duration": duration, "warmup": warmup, "floor_seconds": base["floor_seconds"],
                           "tgw_workers": a.tgw_workers, "flask_workers": a.flask_workers,
                           "floor_procs": a.floor_procs, "procs": a.procs, "systems": a.systems,
                           "http_generator": res.get("flask_server", {}).get("generator", "-")},
              **res}
    print()
    print(format_text(table_rows(result["scenarios"])))
    dest = _out_dir(a)
    stem = f"{date}{'' if mode == 'full' else '-' + mode}"
    json_path = os.path.join(dest, "results", f"{stem}.json")
    png_path = os.path.join(dest, "results", f"{stem}.png")
    write_json(json_path, result)
    try:
        out.plot(result, png_path)
    except Exception as exc:  # noqa: BLE001 - matplotlib is optional
        print(f"no plot: {type(exc).__name__}: {exc}", file=sys.stderr)
    if not a.no_results_md:
        md = os.path.join(dest, "RESULTS.md")
        out.update_results_md(md, mode, out.section_markdown(
            result, os.path.relpath(json_path, dest), os.path.relpath(png_path, dest)))
        print(f"\nupdated {md} ({mode} section)")
    print(f"wrote {json_path} and {png_path}; {result['wall_s']:.0f} s")
    return 0 if _complete(result) else 1


def _complete(result: dict[str, Any]) -> bool:
    ok = all("error" not in row and not row.get("requests_failed")
             for sc in result["scenarios"] for row in sc["rows"].values())
    srv = result.get("tgw_server", {})
    return ok and srv.get("exit_status", 0) == 0 and not srv.get("shm_leftovers")


if __name__ == "__main__":
    sys.exit(main())
