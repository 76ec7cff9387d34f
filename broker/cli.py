"""`tgw-broker`: start (with a config, or the embedded demo) and check-config."""
from __future__ import annotations

import argparse
import logging
import sys

from .config import ConfigError, load_config


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="tgw-broker", description="tgw torch inference gateway broker")
    sub = ap.add_subparsers(dest="cmd", required=True)
    start = sub.add_parser("start", help="serve (the embedded demo models when no --config is given)")
    start.add_argument("--config", help="YAML config file")
    start.add_argument("--address", help="override server.address, e.g. ipc:///run/tgw/tgw.sock")
    start.add_argument("--log-level", default="INFO")
    check = sub.add_parser("check-config", help="validate a config file (model files included) and exit")
    check.add_argument("file")
    args = ap.parse_args(argv)

    if args.cmd == "check-config":
        try:
            cfg = load_config(args.file)
        except ConfigError as exc:
            sys.exit(str(exc))
        print(f"{args.file}: OK ({len(cfg.models)} model(s): {', '.join(m.name for m in cfg.models)})")
        return

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .demo import demo_config
    from .main import run_broker
    try:
        cfg = load_config(args.config) if args.config else demo_config()
    except ConfigError as exc:
        sys.exit(str(exc))
    sys.exit(run_broker(cfg, args.address))
