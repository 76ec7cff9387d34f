"""`tgw-broker check-config --load`: load every model and stage of a config as a worker would,
in one child process (`python -m tgw.workers.check_load`: the broker never imports torch), and
report each as a load does: "ok (load 1.2 s, 44.7 MiB)" or the load's short failure text.

The specs are the ones the broker would send its workers (models/entry.py), every version of
every model, on-demand ones too; no broker starts, no socket or shared memory is made.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from typing import Callable

import msgspec

from tgw.broker.config.load import Config
from tgw.broker.models.entry import ModelEntry
from .load_progress import duration

CHILD = "tgw.workers.check_load"


def specs_of(cfg: Config) -> list[dict]:
    """Every version of every model, as the broker would ask a worker to load it."""
    specs = []
    for decl in cfg.models:
        entry = ModelEntry(decl)
        specs += [msgspec.to_builtins(entry.spec(rec)) for rec in entry.records.values()]
    return specs


def first_device(cfg: Config) -> str:
    devices = cfg.workers.devices
    return devices if isinstance(devices, str) else str(devices[0])


def check_load(cfg: Config, say: Callable[[str], None] = print, verbose: bool = False) -> bool:
    """Load each version in the child and `say` one line each; True when every one loaded.

    What torch and the handlers write while they load (warnings, tracebacks a library logs) is
    kept aside: each failure's short text says what matters, and `verbose` shows it all after
    the report, as does a child that dies."""
    request = {"device": first_device(cfg), "preload": list(cfg.workers.preload), "specs": specs_of(cfg)}
    say(f"loading {len(request['specs'])} version(s) on {request['device']} in a child process:")
    with tempfile.TemporaryFile("w+") as chatter:
        child = subprocess.Popen([sys.executable, "-m", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=chatter, text=True)
        child.stdin.write(json.dumps(request))
        child.stdin.close()
        pending, ok = None, True   # the version the child is loading now
        for line in child.stdout:
            report = json.loads(line)
            if report.get("phase") == "loading":
                pending = report["key"]
                continue
            pending = None
            ok = ok and report["ok"]
            say(f"  {report['key']}: {outcome(report)}")
        code = child.wait()
        died = pending is not None or (code != 0 and ok)   # e.g. a crash inside a native library
        if died:
            say(f"  {pending or 'check'}: FAILED: the loading process ended with {exit_text(code)}")
        chatter.seek(0)
        lines = chatter.read().splitlines()
    if lines and (verbose or died):
        say(f"what the loading process wrote ({len(lines)} lines):")
        for line in lines:
            say(f"  | {line}")
    elif lines:
        say(f"(torch and the handlers wrote {len(lines)} more line(s) while loading: --verbose shows them)")
    return ok and not died


def outcome(report: dict) -> str:
    """ "ok (load 1.2 s, 44.7 MiB)", or "FAILED: " and the load's text (its later lines indented)."""
    if not report["ok"]:
        return "FAILED: " + report["error"].strip().replace("\n", "\n    ")
    figures = [f"load {duration(report['seconds'])}"] + ([size(report["bytes"])] if report["bytes"] else [])
    return f"ok ({', '.join(figures)})"


def size(n: int) -> str:
    if n >= 2**20 / 10:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} B"


def exit_text(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"exit {code}"
