"""tgw-bench: the benchmark's one entry (bench/README.md).

    tgw-bench load --model mlp --concurrency 1,16,64 --json out.json --plot out.png   # closed loop
    tgw-bench load --model resnet --rate 50,100,200     # open loop: Poisson arrivals, latency from schedule
    tgw-bench compare --quick                           # also: python bench/compare.py --quick
    tgw-bench overload --quick                          # 2x capacity by priority, adaptive limit on/off
    tgw-bench lifecycle [--quick]                       # hot swap, canary, unload RSS, on-demand residency
    tgw-bench pipeline [--quick]                        # classify pipeline vs floor, Flask, caller-decodes
    tgw-bench cancel [--requests 1000]                  # callers giving up behind a slow batch: never computed
    tgw-bench fleet [--quick]                           # three brokers behind HAProxy: kill, roll, swap, scale

`load` drives a running broker, one level after the other; `tgw-bench --model ...` without a
subcommand is `load`. `compare` writes bench/results/ and RESULTS.md. `overload` (overload.py)
`lifecycle` (lifecycle_run.py) and `pipeline` (pipeline_bench.py) start their own brokers. Exit status: 0 success (compare: every row filled, no request failed, the
broker stopped cleanly; overload: the runs completed, targets printed), 1 some requests failed
(overload: went unanswered), 2 usage or connection problems, 130 interrupted.
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
from typing import Optional

from tgw.bench import cancel_bench, comparison, fleet, lifecycle_run, overload, pipeline_bench, plots, report
from tgw.bench.loadgen import LoadSpec
from tgw.bench.measure import measure
from tgw.bench.selfhosted import subset
from tgw.bench.targets import GENERATORS, VAR_LEN, TgwTarget, find_model


def _levels(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive numbers separated by commas, got {text!r}")
    return vals


def parser(prog: str = "tgw-bench") -> argparse.ArgumentParser:
    description, epilog = __doc__.split("\n\n", 1)
    ap = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    ld = sub.add_parser("load", help="load a running broker")
    ld.add_argument("--address", help="broker address (default: $TGW_ADDRESS or the runtime-dir socket)")
    ld.add_argument("--model", required=True)
    ld.add_argument("--version", help="model version (default: the model's default version)")
    level = ld.add_mutually_exclusive_group()
    level.add_argument("--concurrency", type=_levels, help="closed loop: requests in flight, e.g. 1,16,64")
    level.add_argument("--rate", type=_levels, help="open loop: Poisson arrivals per second, e.g. 100,500")
    ld.add_argument("--duration", type=float, default=10.0, help="measured seconds per level (default 10)")
    ld.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds before each level (default 2)")
    ld.add_argument("--batch", type=int, default=1, help="rows per request (default 1)")
    ld.add_argument("--input", choices=GENERATORS, default="random", help="input generator (default random)")
    ld.add_argument("--var-len", type=int, default=VAR_LEN, help=f"length used for -1 dims (default {VAR_LEN})")
    ld.add_argument("--timeout", type=float, help="per-request timeout in seconds (default: the model's)")
    ld.add_argument("--max-inflight", type=int, default=256,
                    help="open loop: sender threads over all processes (default 256)")
    ld.add_argument("--json", metavar="FILE", help="write every level's result as JSON")
    ld.add_argument("--plot", metavar="FILE.png", help="plot latency percentiles against offered load")

    cmp = sub.add_parser("compare", help="in-process floor, transport floor, tgw, Flask+gunicorn side by side")
    cmp.add_argument("--quick", action="store_true", help="short runs (about 90 s in all) for development")
    cmp.add_argument("--duration", type=float, help="override: measured seconds per row")
    cmp.add_argument("--warmup", type=float, help="override: warm-up seconds per row")
    cmp.add_argument("--systems", default=list(report.SYSTEMS), type=subset(report.SYSTEMS),
                     help=f"comma-separated subset of {','.join(report.SYSTEMS)} (default: all)")
    models = tuple(dict.fromkeys(sc.model for sc in comparison.SCENARIOS))
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

    overload.add_parser(sub)
    lifecycle_run.add_parser(sub)
    pipeline_bench.add_parser(sub)
    cancel_bench.add_parser(sub)
    fleet.add_parser(sub)

    for p in (ld, cmp):
        p.add_argument("--procs", type=int, default=0, help="generator processes (default: half the cores, 2..4)")
    return ap


def load(a: argparse.Namespace) -> int:
    from tgw.client import Client
    from tgw.shm.paths import default_address

    if a.batch < 1 or a.duration <= 0 or a.warmup < 0:
        print("tgw-bench: --batch must be >= 1, --duration > 0, --warmup >= 0", file=sys.stderr)
        return 2
    address, runs = a.address or default_address(), []
    mode, levels = ("open", a.rate) if a.rate else ("closed", a.concurrency or [1.0])
    try:
        with Client(address) as c:
            meta = find_model(c.models(), a.model)
            if a.batch > meta["max_batch_size"]:
                raise LookupError(f"--batch {a.batch} exceeds {a.model}'s max_batch_size {meta['max_batch_size']}")
            target = TgwTarget(address, a.model, a.batch, a.version, a.timeout, a.var_len, a.input)
            processes = c.stats()["processes"]
            for lv in levels:
                spec = LoadSpec(mode, lv if mode == "open" else int(lv), a.duration, a.warmup, a.procs, a.max_inflight)
                runs.append({**measure(target, spec, processes, stats=c.stats), "model": a.model})
                print(report.format_summary(runs[-1]), flush=True)
    except (ConnectionError, RuntimeError, LookupError) as exc:
        print(f"tgw-bench: {exc}", file=sys.stderr)
        return 2
    if len(runs) > 1:
        print("\n" + report.text_table(report.level_table(runs), 0))
    if a.json:
        report.write_json(a.json, {"address": address, "model": a.model, "model_meta": meta, "mode": mode,
                                   "runs": runs, "command": a.command_line})
        print(f"wrote {a.json}")
    if a.plot:
        plots.plot_levels(runs, a.plot, f"tgw-bench {a.model} ({mode} loop)")
        print(f"wrote {a.plot}")
    return 1 if any(s["requests_failed"] for s in runs) else 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # SIGTERM unwinds like Ctrl-C: `finally` stops what was started


def main(argv: Optional[list[str]] = None, prog: str = "tgw-bench", command: Optional[str] = None) -> int:
    """command: a fixed subcommand (bench/compare.py passes "compare" and its own prog)."""
    args = list(sys.argv[1:] if argv is None else argv)
    full = ([command] if command else []) + args
    if full and full[0] not in ("load", "compare", "overload", "lifecycle", "pipeline", "cancel", "fleet", "-h",
                                       "--help"):
        full.insert(0, "load")  # the form without a subcommand
    a = parser(prog).parse_args(full)
    a.command_line = " ".join([prog, *map(shlex.quote, args)])
    try:
        if a.command == "load":
            return load(a)
        signal.signal(signal.SIGTERM, _interrupt)
        if a.command == "overload":
            return overload.run(a)
        if a.command == "lifecycle":
            return lifecycle_run.run(a)
        if a.command == "pipeline":
            return pipeline_bench.run(a, a.command_line)
        if a.command == "cancel":
            return cancel_bench.run(a, a.command_line)
        if a.command == "fleet":
            return fleet.run(a, a.command_line)
        return comparison.run(a, a.command_line)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
