"""`python -m tgw.broker.fronts --run-dir DIR --index I --config-json FILE`: one front process
(process.py says what it does and how it ends); the broker's fleet starts it, not a person."""
from __future__ import annotations

import argparse
import logging
import sys

import setproctitle
import uvloop

from tgw.broker.config.startup import StartupError
from tgw.broker.observe.logs import setup

from .process import Front, read_spec

log = logging.getLogger("tgw.broker")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tgw.broker.fronts", description=__doc__)
    parser.add_argument("--run-dir", required=True, help="the broker's run directory (the fronts socket's)")
    parser.add_argument("--index", required=True, type=int, help="which front this is: 0..N-1")
    parser.add_argument("--config-json", required=True, help="the fleet's JSON: the config and the faces' addresses")
    args = parser.parse_args(argv)
    setproctitle.setproctitle(f"tgw-front-{args.index}")
    try:
        cfg, spec = read_spec(args.config_json)
        setup(spec.get("log_format", "text"), spec.get("log_level", "INFO"))
        return uvloop.run(Front(cfg, spec, args.run_dir, args.index).run())
    except StartupError as exc:
        logging.basicConfig()
        log.error("front %d: start-up failed: %s", args.index, exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
