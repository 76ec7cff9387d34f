"""`python -m tgw.workers.check_load`: the child process of `tgw-broker check-config --load`.

Loads and warms up each model (and stage) as a starting worker does (make_runner under
measure_load, after the config's preloads), one after another, and reports each on stdout as
one JSON line: {"key", "phase": "loading"} before it, then {"key", "ok", "seconds", "bytes"} or
{"key", "ok": false, "error"} (error_text, the short text a load answers with). It opens no
socket and no shared memory: the broker side (broker/cli/check_load.py) sends the ModelSpecs it
would send a worker, as JSON on stdin: {"device", "preload", "specs"}.
"""
from __future__ import annotations

import json
import os
import sys
import time

import msgspec
import torch

from tgw.shm.wire import ModelSpec, model_key

from .footprint import measure_load
from .load_errors import error_text, watch_torch_warnings
from .loader import release_memory
from .main import preload
from .stage_runner import make_runner


def device_of(name: str) -> torch.device:
    """The config's first device; "auto" as the broker resolves it: the first GPU, else the CPU."""
    if name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def check(spec: ModelSpec, device: torch.device) -> dict:
    t0 = time.perf_counter()
    try:
        runner = measure_load(lambda: make_runner(spec, device), device)
    except Exception as exc:
        release_memory(device)
        return {"ok": False, "error": error_text(exc)}
    report = {"ok": True, "seconds": time.perf_counter() - t0, "bytes": runner.nbytes}
    del runner
    release_memory(device)
    return report


def main() -> int:
    request = json.load(sys.stdin)
    # the results go on the real stdout; what torch or a handler prints goes to stderr
    results = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    def say(key: str, **fields) -> None:
        results.write(json.dumps({"key": key, **fields}) + "\n")

    watch_torch_warnings()   # a failed load's cause can be in a warning torch logs (load_errors.py)
    try:
        preload(request.get("preload") or [])
        device = device_of(request.get("device") or "cpu")
    except Exception as exc:   # a bad preload or device fails every load: said once
        say("<preload>", ok=False, error=error_text(exc))
        return 1
    failed = 0
    for spec in msgspec.convert(request["specs"], list[ModelSpec]):
        key = model_key(spec.name, spec.version)
        say(key, phase="loading")
        report = check(spec, device)
        failed += not report["ok"]
        say(key, **report)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
