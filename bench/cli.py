"""tgw-bench: the benchmarks' one entry - `tgw-bench NAME [options]`, NAME a scenario
(bench/scenarios/; bench/README.md says what each measures).

    tgw-bench load --model mlp --concurrency 1,16,64 --json out.json --plot out.png   # a running broker
    tgw-bench load --model resnet --rate 50,100,200     # open loop: Poisson arrivals, latency from schedule
    tgw-bench compare [--quick]                         # floors, tgw and Flask+gunicorn side by side
    tgw-bench overload [--quick]                        # 2x capacity by priority, adaptive limit on/off
    tgw-bench fleet [--quick]                           # three brokers behind HAProxy: kill, roll, swap, scale
    tgw-bench formats                                   # torchscript, export, aoti beside their own floors
    tgw-bench compress [--rule]                         # lz4 and wire precision; the figures behind "auto"
    tgw-bench gpu [--quick] [--device cpu]              # on a GPU box: floor, tgw per host-memory mode, Flask
    tgw-bench generate [--quick]                        # streamed generation: floor, Flask, one-shot, LitServe, tgw
    tgw-bench generate-faces [--quick]                  # one generator over native, gRPC, HTTP SSE, OpenAI streams
    tgw-bench sequences [--quick]                       # a sequence model's steps against one-shot requests
    tgw-bench onnx [--quick]                            # an ONNX resnet: onnxruntime's own floor, tgw, TorchScript
    tgw-bench triton-ensemble [--quick]                 # a Triton repository's ensemble: tgw against PyTriton
    tgw-bench torchserve [--quick]                      # the same .mar archives on TorchServe and tgw's /predictions
    tgw-bench gc-pauses [--quick] [--face grpc]         # the broker's GC pauses and p99.9, gc_freeze off and on

`tgw-bench --model ...` without a name is `load`. Every scenario but `load` starts its own
brokers and stops them by PID, also on Ctrl-C and SIGTERM. Exit status: 0 success, 1 some
requests failed (each scenario's docstring says what else counts), 2 usage or connection
problems, 130 interrupted. Retired scenarios: bench/results/RETIRED.md.
"""
from __future__ import annotations

import argparse
import shlex
import signal
import sys
from typing import Optional

from tgw.bench.scenarios import NAMES, scenario


def parser(prog: str = "tgw-bench") -> argparse.ArgumentParser:
    description, epilog = __doc__.split("\n\n", 1)
    ap = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True, metavar="NAME")
    for name in NAMES:
        module = scenario(name)
        doc = (module.__doc__ or "").strip()
        first, _, rest = doc.partition("\n\n")
        p = sub.add_parser(name, help=module.HELP, description=first, epilog=rest or None,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
    return ap


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # SIGTERM unwinds like Ctrl-C: `finally` stops what was started


def main(argv: Optional[list[str]] = None, prog: str = "tgw-bench") -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    full = ["load", *args] if args and args[0] not in (*NAMES, "-h", "--help") else args  # the form without a name
    a = parser(prog).parse_args(full)
    a.command_line = " ".join([prog, *map(shlex.quote, args)])
    try:
        if a.command != "load":
            signal.signal(signal.SIGTERM, _interrupt)
        return scenario(a.command).run(a)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":   # `python -m tgw.bench.cli` is `tgw-bench`
    sys.exit(main())
