"""The demo models as the tests and the benchmarks serve them: built at run time in a private work
folder (`python -m tgw.workers.demo_models` in a subprocess, so torch stays out of the caller;
nothing is downloaded), the comparison's tgw config over them, and `demo_broker`, a broker of its
own for the long-running checks (tests/tools/fuzz.py, tests/tools/soak.py): a BrokerProc stopped
by PID and the folder removed however the run ends, with the entry and parser of such a command."""
from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Callable, Iterator, Optional

from tgw.testing.child import BrokerProc


def demo_models(out_dir: str) -> dict[str, dict[str, Any]]:
    """The product's demo models, built by `python -m tgw.workers.demo_models` in a subprocess (as
    the broker does) so torch stays out of the harness and of its generator processes. Returns
    name -> {path, inputs, outputs, max_batch_size} plus `resnet224`: the resnet file declared
    [3,224,224], so one request carries 602 KB."""
    proc = subprocess.run([sys.executable, "-m", "tgw.workers.demo_models", out_dir],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"building the demo models failed:\n{proc.stderr[-2000:]}")
    models = json.loads(proc.stdout.strip().splitlines()[-1])
    r = models["resnet"]
    models["resnet224"] = {**r, "inputs": [{**r["inputs"][0], "shape": [3, 224, 224]}], "max_batch_size": 16}
    return models


def tgw_config(models: dict[str, dict[str, Any]], names: list[str], workers: int) -> dict[str, Any]:
    """The broker of the tgw rows; its HTTP and gRPC faces (the tgw HTTP and gRPC rows) on any free
    ports of 127.0.0.1."""
    return {"server": {"max_request_bytes": 64 << 20}, "http": {"host": "127.0.0.1", "port": 0},
            "grpc": {"host": "127.0.0.1", "port": 0},
            "workers": {"devices": ["cpu"] * workers, "threads_per_worker": 1},  # arenas: auto
            "models": [{"name": n, "versions": [{"version": "1", "path": models[n]["path"]}],
                        "inputs": models[n]["inputs"], "outputs": models[n]["outputs"],
                        "max_batch_size": models[n]["max_batch_size"], "max_queue": 4096, "timeout_ms": 60000,
                        "warmup_batch_sizes": [1]} for n in names]}


class StartError(RuntimeError):
    """The broker (or its models) could not be started."""


@contextlib.contextmanager
def demo_broker(names: list[str], workers: int, tweak: Optional[Callable[[dict], None]] = None,
                keep: bool = False, out: Callable[[str], None] = print) -> Iterator[tuple[BrokerProc, dict]]:
    """Yields (started broker, models: name -> {path, inputs, outputs, max_batch_size});
    `tweak(config)` may change the config first. Raises StartError when it does not start."""
    work = tempfile.mkdtemp(prefix="tgwsh-", dir="/tmp")  # ipc paths must stay under 107 bytes
    broker = None
    try:
        try:
            models = demo_models(work)
            cfg = tgw_config(models, names, workers)
            if tweak:
                tweak(cfg)
            broker = BrokerProc(cfg, work).start(timeout=120)
        except (RuntimeError, TimeoutError) as exc:
            raise StartError(str(exc)) from None
        out(f"broker pid {broker.pid} at {broker.address}, {workers} worker(s); log {broker.log_path}")
        yield broker, models
    finally:
        if broker is not None:
            broker.stop()  # a no-op when the run stopped it already
        if keep:
            out(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def run_command(run: Callable[..., tuple[int, dict]], argv: Optional[list[str]] = None) -> int:
    """A demo_broker command's entry (tests/tools/): run(argv)'s exit status; 2 when the broker did
    not start, 130 on Ctrl-C."""
    try:
        return run(argv)[0]
    except StartError as exc:
        print(f"the broker did not start: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def command_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """A command's argument parser, its help from the module docstring: the first paragraph as the
    description, everything after the second (the usage lines) as the epilog."""
    parts = doc.split("\n\n", 2)
    return argparse.ArgumentParser(prog=prog, description=parts[0], epilog=parts[2] if len(parts) > 2 else None,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
