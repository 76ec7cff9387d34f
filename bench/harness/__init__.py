"""tgw.bench.harness: what the scenarios share - load generators, measurement, the baselines tgw is
compared with, the comparison's servers and ratios, reports and plots (bench/README.md, "Layout").

| module | what it holds |
|---|---|
| `loadgen.py` | closed and open loop generator processes and threads (`LoadSpec`, `run_load`) |
| `openloop.py` | an open loop by priority: one sender thread per request in flight, answers by level, targets |
| `wrk.py` | HTTP rows driven by wrk (its Lua script, run and parse; the install hint) |
| `targets.py` | what a generator thread calls (tgw native, raw zmq echo, HTTP, gRPC) and the inputs it sends |
| `face_load.py` | `tgw-bench faces`: its clients (AsyncClient, the gRPC stub on one channel, one gRPC stream) and the CPU watch (the scheduler loop's thread, broker, fronts) |
| `measure.py` | one measured level: the drive, the broker's stats diff, the process monitor, the summary |
| `baselines.py` | the in-process floor, the transport echo, Flask + gunicorn |
| `comparison.py` | the comparison's scenarios and servers, one row per (scenario, system), its ratios |
| `torchserve_server.py`, `tgw_model_store.py`, `ts_floor.py` | the real TorchServe as a baseline; tgw serving a TorchServe model store; an archive's handler alone in one process (`tgw-bench torchserve`) |
| `fleet.py`, `haproxy.py` | brokers behind HAProxy (the recipe rendered for the run) and their checked HTTP load |
| `report.py`, `plots.py` | every output: text tables, RESULTS.md sections, machine description, JSON; the plots |

It may import tgw.testing (the broker in a child process, the demo models), never a scenario.
"""
from __future__ import annotations

import argparse


def subset(known: tuple[str, ...]):
    """An argparse type: a comma-separated subset of `known`."""
    def parse(text: str) -> list[str]:
        names = [x for x in text.split(",") if x]
        if not names or set(names) - set(known):
            raise argparse.ArgumentTypeError(f"choose from {','.join(known)}, got {text!r}")
        return names
    return parse
