"""tgw-bench: load a running tgw broker and report throughput, latency, errors, batching, memory.

    tgw-bench --model mlp --concurrency 1,16,64 --duration 10 --json out.json --plot out.png
    tgw-bench --model resnet --rate 50,100,200 --duration 20

Closed loop (--concurrency N: N requests always in flight) or open loop (--rate R: Poisson
arrivals at R requests/s, latency counted from each request's scheduled send time). A list of
levels runs one after the other against the same broker. Exit status: 0 when every request
succeeded, 1 when some failed, 2 on usage or connection problems.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

from tgw.bench import report
from tgw.bench.inputs import GENERATORS, VAR_LEN, find_model
from tgw.bench.loadgen import LoadSpec
from tgw.bench.runner import measure
from tgw.bench.targets import TgwTarget


def _levels(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of numbers, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"levels must be positive, got {text!r}")
    return vals


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tgw-bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--address", help="broker address (default: $TGW_ADDRESS or the runtime-dir socket)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--version", help="model version (default: the model's default version)")
    load = ap.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=_levels, help="closed loop: requests in flight, e.g. 1,16,64")
    load.add_argument("--rate", type=_levels, help="open loop: Poisson arrivals per second, e.g. 100,500")
    ap.add_argument("--duration", type=float, default=10.0, help="measured seconds per level (default 10)")
    ap.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds before each level (default 2)")
    ap.add_argument("--batch", type=int, default=1, help="rows per request (default 1)")
    ap.add_argument("--input", choices=GENERATORS, default="random", help="input generator (default random)")
    ap.add_argument("--var-len", type=int, default=VAR_LEN, help=f"length used for -1 dims (default {VAR_LEN})")
    ap.add_argument("--timeout", type=float, help="per-request timeout in seconds (default: the model's)")
    ap.add_argument("--procs", type=int, default=0, help="generator processes (default: half the cores, 2..4)")
    ap.add_argument("--max-inflight", type=int, default=256,
                    help="open loop: sender threads over all processes (default 256)")
    ap.add_argument("--json", metavar="FILE", help="write every level's result as JSON")
    ap.add_argument("--plot", metavar="FILE.png", help="plot latency percentiles against offered load")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar even on a terminal")
    return ap


def run(a: argparse.Namespace) -> dict[str, Any]:
    from tgw.client import Client
    from tgw.shm.paths import default_address

    address = a.address or default_address()
    with Client(address) as c:
        meta = find_model(c.models(), a.model)
        if a.batch > meta["max_batch_size"]:
            raise LookupError(f"--batch {a.batch} exceeds {a.model}'s max_batch_size {meta['max_batch_size']}")
        processes = c.stats()["processes"]
        mode, levels = ("open", a.rate) if a.rate else ("closed", a.concurrency or [1.0])
        target = TgwTarget(address, a.model, a.batch, a.version, a.timeout, a.var_len, a.input)
        runs = []
        for level in levels:
            spec = LoadSpec(mode, level if mode == "open" else int(level), a.duration, a.warmup, a.procs,
                            a.max_inflight)
            s = measure(target, spec, processes, a.batch, stats_fn=c.stats, model=a.model,
                        label=f"{a.model} {'c=' if mode == 'closed' else ''}{level:g}{'/s' if mode == 'open' else ''}",
                        progress=False if a.no_progress else None)
            s["model"] = a.model
            runs.append(s)
            print(report.format_summary(s), flush=True)
    if len(runs) > 1:
        print()
        print(report.format_table(runs))
    return {"address": address, "model": a.model, "model_meta": meta, "mode": mode, "runs": runs,
            "command": " ".join(["tgw-bench", *sys.argv[1:]])}


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.batch < 1 or a.duration <= 0 or a.warmup < 0:
        parser().error("--batch must be >= 1, --duration > 0, --warmup >= 0")
    try:
        result = run(a)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ConnectionError, RuntimeError, LookupError) as exc:
        print(f"tgw-bench: {exc}", file=sys.stderr)
        return 2
    if a.json:
        report.write_json(a.json, result)
        print(f"wrote {a.json}")
    if a.plot:
        report.plot_levels(result["runs"], a.plot, f"tgw-bench {a.model} ({result['mode']} loop)")
        print(f"wrote {a.plot}")
    return 1 if any(s["requests_failed"] for s in result["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
