"""The fleet's brokers: each a `tgw-broker start` with one CPU worker and its HTTP face on a port
of its own, fixed for the run so a broker restarted (after SIGKILL or SIGTERM) comes back where
the balancer looks for it. The model is "m", version k computing x + k (bench/lifecycle.py),
and "heavy" (x + 1, compute-bound), built in a subprocess so torch stays out of the harness.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from tgw.bench.fleet_haproxy import Server, free_port
from tgw.bench.lifecycle import WIDTH, control, model_decl
from tgw.broker.child import _LIVE, BrokerProc
from tgw.shm.wire import LoadVersion

MODEL = "m"
HEAVY = "heavy"    # the scaling phase's model: x + 1 after about 1 ms of matmuls per row (width 1024)
VERSIONS = (1, 2, 3)


def save_heavy_model(path: str, k: float, width: int = 1024, rounds: int = 16) -> str:
    """y = x + k once `rounds` tanh(h @ W) over `width` are computed (and multiplied by 0), so
    throughput is bound by the worker's core, the thing the scaling phase pins."""
    import torch

    class Heavy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.register_buffer("k", torch.tensor([float(k)]))
            self.register_buffer("lift", torch.randn(WIDTH, width, generator=g))
            self.register_buffer("w", torch.randn(width, width, generator=g) / width ** 0.5)
            self.rounds = rounds

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x @ self.lift
            for _ in range(self.rounds):
                h = torch.tanh(h @ self.w)
            return x + self.k + 0.0 * h[:, :1]

    torch.jit.save(torch.jit.script(Heavy()), path)
    return path


def build_models(d: str) -> dict:
    """version -> TorchScript file of y = x + version, and HEAVY -> the heavy one (x + 1)."""
    paths = {k: os.path.join(d, f"add{k}.pt") for k in VERSIONS}
    code = ("import json, sys; from tgw.bench.lifecycle import save_add_model; "
            "from tgw.bench.fleet_members import save_heavy_model; p = json.loads(sys.argv[1]); "
            "[save_add_model(p[k], int(k)) for k in p if k.isdigit()]; save_heavy_model(p['heavy'], 1)")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps({**paths, HEAVY: os.path.join(d, "heavy.pt")})],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"building the fleet's models failed:\n{proc.stderr[-2000:]}")
    return {**paths, HEAVY: os.path.join(d, "heavy.pt")}


DRAIN_NOTICE_S = 1.5


def config(port: int, paths: dict, heavy: bool) -> dict:
    """heavy: serve HEAVY too (only the scaling phase needs it; it slows every start a little)."""
    names = [(MODEL, paths[1])] + ([(HEAVY, paths[HEAVY])] if heavy else [])
    # not ready for longer than HAProxy's `inter 500ms fall 2` takes to mark it down, before draining
    return {"server": {"drain_notice_s": DRAIN_NOTICE_S}, "http": {"host": "127.0.0.1", "port": port},
            "workers": {"devices": ["cpu"], "threads_per_worker": 1, "input_arena_mb": 4, "output_arena_mb": 4},
            "models": [model_decl(n, [("1", p)], max_queue=4096, timeout_ms=30000) for n, p in names]}


class Member:
    def __init__(self, name: str, work: str, paths: dict, heavy: bool = True):
        self.name, self.port = name, free_port()
        self.dir = os.path.join(work, name)
        os.makedirs(self.dir, exist_ok=True)
        self.broker = BrokerProc(config(self.port, paths, heavy), self.dir)
        self.broker.name = f"tgw broker {name}"
        self.started_pids: list[int] = []   # every broker and worker PID it started, for the record

    @property
    def server(self) -> Server:
        return Server(self.name, self.port)

    @property
    def address(self) -> str:
        return self.broker.address

    def start(self, wait: bool = True) -> "Member":
        self.broker.start(wait=False)
        self.started_pids.append(self.broker.pid)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 180.0) -> None:
        self.broker.wait_ready(timeout)
        self.started_pids.extend(p for p in self.pids() if p not in self.started_pids)

    def alive(self) -> bool:
        return self.broker.alive()

    def kill(self) -> None:
        """SIGKILL the broker (its workers die with it: PR_SET_PDEATHSIG) and reap it."""
        proc = self.broker.proc
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        _LIVE.pop(proc.pid, None)

    def stop(self, timeout: float = 60.0) -> tuple[int, float]:
        """SIGTERM, wait for the exit; (exit status, seconds it took)."""
        t0 = time.monotonic()
        rc = self.broker.stop(timeout)
        return rc, time.monotonic() - t0

    def load_version(self, version: int, path: str) -> dict:
        """The broker's hot swap: load beside, flip the default, drain and unload the old one."""
        t0 = time.monotonic()
        reply = control(self.address, LoadVersion(v=0, model=MODEL, version=str(version), path=path))
        return {"broker": self.name, "version": version, "seconds": round(time.monotonic() - t0, 2),
                "message": reply.message}

    def pids(self) -> list[int]:
        """The broker's and its workers' PIDs (Client.stats()["processes"])."""
        from tgw.client import Client
        with Client(self.address) as c:
            return [p["pid"] for p in c.stats()["processes"]]

    def pin(self, cores: set[int]) -> list[int]:
        """Every thread of the broker and of its workers onto `cores` (as `taskset -a -p`)."""
        pids = self.pids()
        for pid in pids:
            for tid in os.listdir(f"/proc/{pid}/task"):
                try:
                    os.sched_setaffinity(int(tid), cores)
                except (ProcessLookupError, FileNotFoundError):
                    pass   # a thread that ended meanwhile
        return pids
