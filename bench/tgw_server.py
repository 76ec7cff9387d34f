"""Start a tgw broker for the benchmarks (its own config, its own ipc socket) and stop it by PID.

The config serves the demo models plus `resnet224`: the same resnet file declared with a
[3,224,224] input, so one request carries 602 KB. It is written as JSON, which is valid YAML.
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from typing import Any, Optional

from tgw.bench.procs import Managed, wait_until

SHM_DIR = "/dev/shm"


def build_demo_models(out_dir: str) -> dict[str, dict[str, Any]]:
    """Build the demo TorchScript files in a subprocess (torch stays out of this process).

    Returns name -> {"path", "inputs", "outputs", "max_batch_size"} plus the `resnet224` alias."""
    proc = subprocess.run([sys.executable, "-m", "tgw.workers.demo_models", out_dir],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"building the demo models failed:\n{proc.stderr[-2000:]}")
    models = json.loads(proc.stdout.strip().splitlines()[-1])
    r = models["resnet"]
    models["resnet224"] = {**r, "inputs": [{**r["inputs"][0], "shape": [3, 224, 224]}], "max_batch_size": 16}
    return models


def write_config(path: str, address: str, models: dict[str, dict[str, Any]], names: list[str],
                 devices: list[str], threads_per_worker: int = 1) -> str:
    cfg = {
        "server": {"address": address, "max_request_bytes": 64 << 20},
        "workers": {"devices": devices, "threads_per_worker": threads_per_worker,
                    "input_arena_mb": 64, "output_arena_mb": 32},
        "models": [{
            "name": n,
            "versions": [{"version": "1", "path": models[n]["path"]}],
            "inputs": models[n]["inputs"], "outputs": models[n]["outputs"],
            "max_batch_size": models[n]["max_batch_size"],
            "max_queue": 4096, "timeout_ms": 60000, "warmup_batch_sizes": [1],
        } for n in names],
    }
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
    return path


def shm_leftovers(pid: int) -> list[str]:
    return sorted(glob.glob(os.path.join(SHM_DIR, f"tgw_*_{pid}_*")))


class TgwServer:
    """`python -m tgw.broker start --config CFG --address ADDR`, ready when health() says so."""

    def __init__(self, address: str, config: Optional[str] = None, log_path: Optional[str] = None,
                 start_timeout: float = 180):
        self.address = address
        argv = [sys.executable, "-m", "tgw.broker", "start", "--address", address]
        if config:
            argv += ["--config", config]
        self.proc = Managed(argv, "tgw-broker", log_path)
        self.pid = self.proc.pid
        try:
            wait_until(self._ready, start_timeout, f"tgw broker ready at {address}", self.proc, 0.2)
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> bool:
        from tgw.client import Client
        with Client(self.address, connect_timeout=2) as c:
            return bool(c.health()["ready"])

    def processes(self) -> list[dict[str, Any]]:
        from tgw.client import Client
        with Client(self.address) as c:
            return list(c.stats()["processes"])

    def stop(self) -> dict[str, Any]:
        """SIGTERM by PID; returns {"exit_status", "shm_leftovers"} (both checked by callers)."""
        status = self.proc.stop(grace=20)
        return {"exit_status": status, "shm_leftovers": shm_leftovers(self.pid)}
