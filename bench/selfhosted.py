"""A broker of its own for the long-running checks (tests/tools/fuzz.py, tests/tools/soak.py): the demo
models built at run time in a private work folder (`python -m tgw.workers.demo_models`, nothing
is downloaded), the comparison's tgw config, a BrokerProc stopped by PID and the folder removed
however the run ends."""
from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
from typing import Callable, Iterator, Optional

from tgw.broker.child import BrokerProc
from tgw.bench.comparison import demo_models, tgw_config


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


def main(run: Callable[..., tuple[int, dict]], argv: Optional[list[str]] = None) -> int:
    """A command's entry: run(argv)'s exit status; 2 when the broker did not start, 130 on Ctrl-C."""
    try:
        return run(argv)[0]
    except StartError as exc:
        print(f"the broker did not start: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """A command's argument parser, its help from the module docstring: the first paragraph as the
    description, everything after the second (the usage lines) as the epilog."""
    parts = doc.split("\n\n", 2)
    return argparse.ArgumentParser(prog=prog, description=parts[0], epilog=parts[2] if len(parts) > 2 else None,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def subset(known: tuple[str, ...]):
    """An argparse type: a comma-separated subset of `known`."""
    def parse(text: str) -> list[str]:
        names = [x for x in text.split(",") if x]
        if not names or set(names) - set(known):
            raise argparse.ArgumentTypeError(f"choose from {','.join(known)}, got {text!r}")
        return names
    return parse
