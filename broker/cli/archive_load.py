"""`tgw-broker models load FILE.mar`: a TorchServe archive of the running broker's model store
registered, as TorchServe's `POST /models?url=FILE.mar` (the broker's TorchServe management API,
found in its status; the token, when one is configured, sent as TorchServe's Bearer token).
"""
from __future__ import annotations

import json
import sys
import urllib.error
import urllib.parse
import urllib.request

from tgw.shm.errors import TgwError
from tgw.shm.wire import PROTOCOL_VERSION, Status

from . import connect

SUFFIXES = (".mar", ".tar.gz", ".tgz")


def is_archive(name: str) -> bool:
    return name.endswith(SUFFIXES)


def register(args) -> int:
    """Register `args.model` (a file name in the model store); 0 once loaded, else 1 with why."""
    from tgw.broker.config.startup import StartupError

    from .ask import Unreachable, ask
    label = "tgw-broker models load"
    try:
        to = connect.resolve(args)
        status = ask(to.address, Status(v=PROTOCOL_VERSION), 5.0, token=to.token, server_key=to.server_key)
    except (Unreachable, TgwError, StartupError, connect.ConnectProblem) as exc:
        print(f"{label}: {exc}", file=sys.stderr)
        return 1
    if not status.torchserve:
        print(f"{label}: {args.model}: this broker serves no model store (start it with --model-store DIR, or "
              "model_store: in its config)", file=sys.stderr)
        return 1
    management = status.torchserve.split()[1]
    query = {"url": args.model}
    for key, value in (("batch_size", args.batch_size), ("max_batch_delay", args.max_batch_delay),
                       ("model_name", args.name)):
        if value is not None:
            query[key] = str(value)
    req = urllib.request.Request(f"{management}/models?{urllib.parse.urlencode(query)}", method="POST",
                                 headers={"Authorization": f"Bearer {to.token}"} if to.token else {})
    try:
        with urllib.request.urlopen(req, timeout=args.timeout) as resp:
            print(json.loads(resp.read())["status"])
            return 0
    except urllib.error.HTTPError as exc:
        body = exc.read()
        try:
            why = json.loads(body)["message"]
        except (ValueError, KeyError):
            why = body.decode(errors="replace")
        print(f"{label}: {args.model}: {why} (HTTP {exc.code})", file=sys.stderr)
    except (urllib.error.URLError, OSError) as exc:
        print(f"{label}: {args.model}: {management}: {exc}", file=sys.stderr)
    return 1
