"""`tgw-bench load`: a running broker under load, one level after the other - closed loop (requests
in flight) or open loop (Poisson arrivals per second, latency from the schedule). Prints each
level's summary and, for several levels, a table; --json keeps every level, --plot draws the
latency percentiles against the offered load. Exit status 1 when a request failed, 2 for usage
and connection problems.

    tgw-bench load --model mlp --concurrency 1,16,64 --json out.json --plot out.png
    tgw-bench load --model resnet --rate 50,100,200
"""
from __future__ import annotations

import argparse
import sys

from tgw.bench.harness import plots, report
from tgw.bench.harness.loadgen import LoadSpec
from tgw.bench.harness.measure import measure
from tgw.bench.harness.targets import GENERATORS, VAR_LEN, TgwTarget, find_model

NAME = "load"
HELP = "load a running broker"


def _levels(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive numbers separated by commas, got {text!r}")
    return vals


def add_arguments(ld: argparse.ArgumentParser) -> None:
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
    ld.add_argument("--procs", type=int, default=0, help="generator processes (default: half the cores, 2..4)")


def run(a: argparse.Namespace) -> int:
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
