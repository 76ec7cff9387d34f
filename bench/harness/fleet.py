"""A fleet of brokers behind a balancer (haproxy.py), and its checked load (`tgw-bench fleet`).

The brokers (`Member`): each a `tgw-broker start` with one CPU worker and its HTTP face on a port
of its own, fixed for the run so a broker restarted (after SIGKILL or SIGTERM) comes back where
the balancer looks for it. The model is "m", version k computing x + k (tgw.testing.lifecycle),
and "heavy" (x + 1, compute-bound), built in a subprocess so torch stays out of the harness.

The load (`Load`): closed-loop HTTP callers through the balancer, every answer checked.
Each of `concurrency` threads keeps one keep-alive connection to HAProxy and one request in
flight, cycling over its own routing keys (sent as the `tgw-routing-key` header, which the
hash variant balances on, and as the request's `routing_key` parameter, which the broker keeps
on one version). Each reply is checked exactly: its `model_version` is one the phase allows and its output is the input plus
that version. A key's versions may only move forward (a key seeing v2 then v1 is counted).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from array import array
from collections import Counter
from typing import Optional

import numpy as np
import orjson

from tgw.bench.harness.haproxy import Server, free_port
from tgw.bench.harness.targets import CallError, HttpConnection, error_code
from tgw.shm.wire import LoadVersion
from tgw.testing.child import _LIVE, BrokerProc
from tgw.testing.lifecycle import WIDTH, control, model_decl

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
    code = ("import json, sys; from tgw.testing.lifecycle import save_add_model; "
            "from tgw.bench.harness.fleet import save_heavy_model; p = json.loads(sys.argv[1]); "
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


# ---- the load: closed-loop HTTP callers through the balancer, every answer checked ----------------

KEYS_PER_CALLER = 4
TRANSPORT_ERRORS = ("ConnectionResetError", "ConnectionRefusedError", "BrokenPipeError", "TimeoutError",
                    "timeout", "ValueError", "OSError")   # no HTTP answer at all: a dropped request


class BodyConnection(HttpConnection):
    """HttpConnection that keeps each reply's body (HttpConnection reads it only to skip it)."""
    keep_body = True


class WrongAnswer(Exception):
    code = "WRONG_ANSWER"


def request(port: int, model: str, key: str, x: np.ndarray) -> bytes:
    body = orjson.dumps({"inputs": [{"name": "x", "shape": [1, WIDTH], "datatype": "FP32",
                                     "data": x.ravel().tolist()}], "parameters": {"routing_key": key}})
    head = (f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\ntgw-routing-key: {key}\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode("latin-1") + body


def check(body: bytes, x: np.ndarray, versions: set[int]) -> int:
    """The reply's version, once its output is x + version and the version is allowed."""
    doc = orjson.loads(body)
    try:
        k = int(doc["model_version"])
        y = np.asarray(doc["outputs"][0]["data"], np.float32)
    except (KeyError, IndexError, ValueError, TypeError) as exc:
        raise WrongAnswer(f"malformed reply {body[:200]!r}: {exc}") from exc
    if k not in versions:
        raise WrongAnswer(f"version {k} not in {sorted(versions)}")
    if not np.array_equal(y, (x + k).ravel()):
        raise WrongAnswer(f"version {k}: {y.tolist()} is not x + {k} for x = {x.ravel().tolist()}")
    return k


class Caller:
    def __init__(self, index: int, port: int, model: str):
        self.keys = [f"key-{index}-{j}" for j in range(KEYS_PER_CALLER)]
        self.inputs = [np.array([[index, j, 0.5, 0.25]], np.float32) for j in range(KEYS_PER_CALLER)]
        self.requests = [request(port, model, k, x) for k, x in zip(self.keys, self.inputs)]
        self.conn = BodyConnection("127.0.0.1", port, 30.0)
        self.ok, self.errors, self.messages = 0, Counter(), {}
        self.done = array("d")            # completion times of the answers (time.monotonic)
        self.versions: Counter = Counter()
        self.last = [0] * KEYS_PER_CALLER
        self.backward: list[str] = []

    def run(self, stop: threading.Event, allowed: list[set[int]]) -> None:
        j = 0
        while not stop.is_set():
            try:
                status = self.conn.exchange(self.requests[j])
                if status != 200:
                    raise CallError(f"HTTP_{status}", repr(self.conn.body[:300]))
                k = check(self.conn.body, self.inputs[j], allowed[0])
            except Exception as exc:  # noqa: BLE001 - every failure is counted by its kind
                code = error_code(exc)
                self.errors[code] += 1
                self.messages.setdefault(code, str(exc)[:300])
            else:
                self.ok += 1
                self.done.append(time.monotonic())
                self.versions[k] += 1
                if k < self.last[j]:
                    self.backward.append(f"{self.keys[j]}: v{k} after v{self.last[j]}")
                self.last[j] = max(self.last[j], k)
            j = (j + 1) % KEYS_PER_CALLER
        self.conn.close()


class Load:
    """`concurrency` callers through the balancer on `port`, from start() to stop()."""

    def __init__(self, port: int, model: str, concurrency: int, versions: set[int]):
        self.callers = [Caller(i, port, model) for i in range(concurrency)]
        self.allowed = [set(versions)]   # a list so the threads see a change at once
        self.stop_event = threading.Event()
        self.threads = [threading.Thread(target=c.run, args=(self.stop_event, self.allowed), daemon=True)
                        for c in self.callers]
        self.t0 = self.t1 = 0.0

    def start(self) -> "Load":
        self.t0 = time.monotonic()
        for t in self.threads:
            t.start()
        return self

    def answered(self) -> int:
        return sum(c.ok for c in self.callers)

    def wait_answers(self, n: int, timeout: float = 60.0) -> None:
        """Until `n` more answers came (a phase's step happens under load, not before it)."""
        goal, deadline = self.answered() + n, time.monotonic() + timeout
        while self.answered() < goal:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the load got {self.answered() - goal + n} of {n} answers in {timeout:g}s: "
                                   f"{self.errors()}")
            time.sleep(0.02)

    def errors(self) -> Counter:
        return sum((c.errors for c in self.callers), Counter())

    def stop(self) -> dict:
        self.stop_event.set()
        for t in self.threads:
            t.join(60)
        self.t1 = time.monotonic()
        errors = self.errors()
        messages: dict[str, str] = {}
        for c in self.callers:
            for k, v in c.messages.items():
                messages.setdefault(k, v)
        backward = [b for c in self.callers for b in c.backward]
        ok = self.answered()
        return {"requests": ok + sum(errors.values()), "ok": ok, "failed": sum(errors.values()),
                "dropped": sum(v for k, v in errors.items() if k in TRANSPORT_ERRORS),
                "errors": dict(errors), "error_messages": messages, "seconds": round(self.t1 - self.t0, 2),
                "throughput_rps": round(ok / max(self.t1 - self.t0, 1e-9), 1),
                "by_version": {str(k): v for k, v in sorted(sum((c.versions for c in self.callers),
                                                                Counter()).items())},
                "backward": backward[:10], "backward_count": len(backward)}

    def longest_stall(self, t_from: float, t_to: float) -> Optional[float]:
        """The longest time in [t_from, t_to] with no answer completing, in seconds (after stop():
        a running caller's array may not be read while it grows)."""
        times = np.sort(np.concatenate([np.frombuffer(c.done, np.float64) for c in self.callers]))
        inside = times[(times >= t_from) & (times <= t_to)]
        if not len(inside):
            return None
        edges = np.concatenate([[t_from], inside, [min(t_to, self.t1 or t_to)]])
        return float(np.max(np.diff(edges)))
