"""HAProxy in front of the fleet's brokers: its config, its process, its stats socket.

The config is configs/haproxy/tgw.cfg (or tgw-hash.cfg, the consistent-hash variant) when the
checkout has it, with its `bind`, `server` and `stats socket` lines replaced by the run's own
(free 127.0.0.1 ports, a Unix socket in the work folder), so the bench measures the recipe users
get; without the recipe, `generated()` writes an equivalent one. HAProxy runs in the foreground
(`-db`) and is stopped by its PID.
"""
from __future__ import annotations

import csv
import os
import re
import resource
import shutil
import socket
import time
from typing import NamedTuple, Optional

from tgw.testing.child import Proc

HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"
# HAProxy asks for about 2 x maxconn + 30 descriptors and refuses to start beyond the hard limit
_FILES = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
MAXCONN = 1 << 30 if _FILES == resource.RLIM_INFINITY else (_FILES - 100) // 2
RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs", "haproxy")
BACKEND = "tgw"      # the recipe's backend (and frontend) name
TOTAL = "BACKEND"    # `show stat`'s row of the backend as a whole


class Server(NamedTuple):
    name: str
    port: int
    enabled: bool = True


def generated(hash_key: bool, inter_ms: int) -> str:
    """What the recipe says (issue 26): leastconn or a consistent hash on the routing-key header,
    active checks on readiness, L7 retries for idempotent inference, redispatch on every retry."""
    balance = ("balance hdr(tgw-routing-key)\n    hash-type consistent" if hash_key else "balance leastconn")
    return f"""global
    maxconn 4096
    stats socket /run/haproxy/tgw.sock mode 600 level admin

defaults
    mode http
    option http-keep-alive
    timeout connect 2s
    timeout client 60s
    timeout server 30s
    timeout queue 30s
    retries 3
    option redispatch 1
    retry-on conn-failure empty-response response-timeout 503

frontend tgw_http
    bind 127.0.0.1:8080
    default_backend {BACKEND}

backend {BACKEND}
    {balance}
    option httpchk GET /v2/health/ready
    http-check expect status 200
    default-server inter {inter_ms}ms fall 2 rise 2
    server tgw1 127.0.0.1:8000 check
"""


def recipe(hash_key: bool) -> Optional[str]:
    path = os.path.join(RECIPES, "tgw-hash.cfg" if hash_key else "tgw.cfg")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read()


def render(text: str, port: int, servers: list[Server], sock: str) -> tuple[str, list[str]]:
    """The recipe with this run's listeners (the first `bind` on `port`, any other, e.g. the
    stats page, on a free port), servers and stats socket; no request log (the bench would
    write a line per request to a file); maxconn within this machine's file limit. Returns the
    text and what was changed beyond the addresses."""
    out, changes, placed, in_backend, binds = [], [], False, False, 0
    for line in text.splitlines():
        words = line.split()
        word = words[0] if words else ""
        if word in ("frontend", "backend", "listen", "defaults", "global"):
            in_backend = word in ("backend", "listen")
        if word == "bind":
            line = re.sub(r"^(\s*bind\s+)\S+", rf"\g<1>127.0.0.1:{port if binds == 0 else free_port()}", line)
            binds += 1
        elif words[:2] == ["stats", "socket"]:
            line = f"    stats socket {sock} mode 600 level admin"
        elif word == "log":
            changes.append(f"dropped `{line.strip()}`")
            continue
        elif word == "maxconn" and int(words[1]) > MAXCONN:
            changes.append(f"`{line.strip()}` -> maxconn {MAXCONN} (the file limit here)")
            line = f"    maxconn {MAXCONN}"
        elif word in ("server", "server-template") and in_backend:
            if not placed:   # the recipe's first server line gives the options (e.g. `check`)
                opts = "".join(f" {w}" for w in words[3:] if w not in ("disabled", "enabled"))
                out.extend(f"    server {s.name} 127.0.0.1:{s.port}{opts}{'' if s.enabled else ' disabled'}"
                           for s in servers)
                placed = True
            continue
        out.append(line)
    if not placed:
        raise ValueError("the haproxy recipe has no `server` line in a backend to replace")
    if not any(line.split()[:2] == ["stats", "socket"] for line in out):
        out.insert(out.index("global") + 1, f"    stats socket {sock} mode 600 level admin")
    return "\n".join(out) + "\n", changes


def check_interval_s(text: str) -> float:
    """The `inter` of the backend's checks (HAProxy's default 2 s when none is given)."""
    m = re.search(r"\binter\s+(\d+)(ms|s)?\b", text)
    return 2.0 if not m else int(m.group(1)) / (1000 if m.group(2) in (None, "ms") else 1)


class Haproxy:
    def __init__(self, work: str, servers: list[Server], hash_key: bool = False, inter_ms: int = 250):
        """inter_ms: the check interval of the generated config (a recipe keeps its own)."""
        self.work, self.servers, self.hash_key = work, servers, hash_key
        self.sock = os.path.join(work, "haproxy-hash.sock" if hash_key else "haproxy.sock")
        self.port = free_port()
        self.source = recipe(hash_key)
        self.origin = (f"configs/haproxy/{'tgw-hash' if hash_key else 'tgw'}.cfg" if self.source
                       else "tgw.bench.harness.haproxy generated()")
        self.config, self.changes = render(self.source or generated(hash_key, inter_ms), self.port, servers,
                                           self.sock)
        self.inter_s = check_interval_s(self.config)
        self.config_path = os.path.join(work, "haproxy-hash.cfg" if hash_key else "haproxy.cfg")
        with open(self.config_path, "w") as f:
            f.write(self.config)
        self.proc = Proc([HAPROXY, "-db", "-f", self.config_path], self.config_path + ".log", "haproxy")

    def start(self, timeout: float = 20.0) -> "Haproxy":
        check = Proc([HAPROXY, "-c", "-f", self.config_path], self.config_path + ".check", "haproxy -c")
        check.start()
        if check.proc.wait(30) != 0:
            raise RuntimeError(f"haproxy refuses {self.config_path}:\n{check.output()[-3000:]}")
        self.proc.start()
        self.proc.wait_for(lambda: bool(self.stat()), timeout, "the stats socket")
        return self

    def stop(self) -> None:
        self.proc.stop(timeout=10)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def command(self, line: str) -> str:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(self.sock)
            s.sendall(line.encode() + b"\n")
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def stat(self) -> dict[str, dict[str, str]]:
        """`show stat` of the backend: server name (and TOTAL, FRONTEND) -> its CSV row."""
        text = self.command("show stat").lstrip("# ")
        rows = csv.DictReader(text.splitlines())
        return {r["svname"]: r for r in rows if r["pxname"] == BACKEND}

    def counters(self) -> dict[str, dict[str, int]]:
        """Per server (and TOTAL): 2xx replies, retries, redispatches, status."""
        return {name: {"2xx": int(r["hrsp_2xx"] or 0), "retries": int(r["wretr"] or 0),
                       "redispatches": int(r["wredis"] or 0), "status": r["status"]}
                for name, r in self.stat().items()}

    def set_state(self, server: str, state: str) -> None:
        reply = self.command(f"set server {BACKEND}/{server} state {state}").strip()
        if reply:
            raise RuntimeError(f"haproxy: set server {server} state {state}: {reply}")

    def wait_status(self, server: str, status: str, timeout: float = 30.0) -> float:
        """Seconds until the server's status is `status` (UP, DOWN, MAINT; not "UP 1/2" on the way)."""
        t0 = time.monotonic()
        self.proc.wait_for(lambda: self.stat()[server]["status"] == status, timeout, f"server {server} {status}")
        return time.monotonic() - t0

    def cpu_s(self) -> float:
        import psutil
        t = psutil.Process(self.pid).cpu_times()
        return t.user + t.system


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
