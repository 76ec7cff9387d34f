"""The front processes' supervision: how many, their run directory and config file, start,
restart, drain and stop, and what status and /metrics show of them.

How many (`front_count`): server.front_processes, or when unset 0 on a box of 4 CPUs or fewer
(one loop serves best there) else a quarter of the CPUs, at most 8.

Each front is `python -m tgw.broker.fronts --run-dir D --index I --config-json F`, a child of
the broker (it watches its parent and exits when the broker dies). F holds the whole config
(`config`) and what a front needs beside it: the hub's address, the public HTTP and gRPC
addresses it serves (the port already resolved: a port 0 is reserved by the broker, see
`reserve_port`), the broker's own faces' Unix sockets it forwards other routes to, the token
file, the broker's pid. A front that exits is started again under the workers' backoff
(fleet/restarts.py: at once after a life that served, exponentially after early deaths);
its admitted requests leave unrun first (hub.py). At stop: DRAIN to every front, up to
supervisor.shutdown_grace_s for them to exit, then SIGTERM, then SIGKILL - by pid, only its own.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Callable

import zmq

from tgw.shm.paths import ipc_path

from tgw.broker.config.schema import ServerDecl, SupervisorDecl
from tgw.broker.config.startup import StartupError
from tgw.broker.fleet.restarts import Restarts

from .hub import FrontsHub

log = logging.getLogger("tgw.supervisor")
MAX_AUTO = 8          # fronts chosen from the cores: at most this many
TERM_WAIT_S = 2.0     # after SIGTERM, before SIGKILL
UNIX_PATH_MAX = 107   # sun_path's 108 bytes, less its terminating NUL


def front_count(server: ServerDecl, cpus: int | None = None) -> int:
    """server.front_processes, or chosen from the CPUs when unset."""
    if server.front_processes is not None:
        return server.front_processes
    cpus = cpus if cpus is not None else (os.cpu_count() or 1)
    return 0 if cpus <= 4 else min(MAX_AUTO, cpus // 4)


def run_dir_of(workers_endpoint: str) -> str:
    """The broker's private folder for its fronts: beside the workers' socket, named as it is
    (ipc://DIR/tgw-PID.w.sock -> DIR/tgw-PID.fronts)."""
    path = ipc_path(workers_endpoint) or workers_endpoint
    return path.removesuffix(".w.sock") + ".fronts"


def fronts_socket(ctx: zmq.Context, run_dir: str) -> zmq.Socket:
    """The run folder made private (0700: only the broker's user may reach what is in it; one
    left by a dead process of the same pid is replaced) and the hub's ROUTER bound in it."""
    longest = os.path.join(run_dir, "http.sock")
    if len(longest.encode()) > UNIX_PATH_MAX:
        raise StartupError(f"front processes' folder {run_dir}: its socket paths ({longest}) would be longer than "
                           f"the {UNIX_PATH_MAX} bytes a Unix socket may have: name a socket in a shorter folder "
                           f"(server.address, --address)")
    try:
        if os.path.isdir(run_dir) and not os.path.islink(run_dir) and os.stat(run_dir).st_uid == os.geteuid():
            shutil.rmtree(run_dir)
        os.mkdir(run_dir, 0o700)
        os.chmod(run_dir, 0o700)   # mkdir's mode passes through the umask
    except OSError as exc:
        raise StartupError(f"front processes' folder {run_dir}: {exc.strerror or exc}") from None
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)   # a reply to a front gone errors instead of queueing
    sock.setsockopt(zmq.SNDHWM, 0)   # no limit: an answer is never dropped for a busy front (its own process)
    sock.setsockopt(zmq.RCVHWM, 0)   # admission bounds what is taken in
    sock.bind(f"ipc://{run_dir}/fronts")
    return sock


def reserve_port(host: str, port: int, face: str) -> socket.socket:
    """A socket bound to (host, port) with SO_REUSEPORT, not listening: the port stays the
    broker's while its fronts listen on it beside (a listening socket of another program there
    is refused first; port 0: the kernel's pick). Raises StartupError."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                   flags=socket.AI_PASSIVE)[0]
        if port:   # a port another program listens on (SO_REUSEPORT or not): refused, never shared
            probe = socket.socket(family, socket.SOCK_STREAM)
            try:   # SO_REUSEADDR: a restart's connections in TIME_WAIT do not hold the port
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(addr)
            finally:
                probe.close()
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(addr)
        return sock
    except OSError as exc:
        raise StartupError(f"{face} face: cannot listen on {host}:{port}: {exc.strerror or exc}") from None


class Front:
    """One index's process, life after life."""
    __slots__ = ("index", "proc", "hello", "restarts", "due_at", "last_death")

    def __init__(self, index: int):
        self.index = index
        self.proc: subprocess.Popen | None = None
        self.hello = False            # its current life said HELLO
        self.restarts = 0
        self.due_at: float | None = None   # dead: when it starts again
        self.last_death = ""


class FrontFleet:
    def __init__(self, count: int, server: ServerDecl, supervisor: SupervisorDecl, run_dir: str, hub: FrontsHub,
                 config: dict, clock: Callable[[], float] = time.monotonic):
        """`run_dir`: the broker's private folder (the hub's socket, the faces' Unix sockets, the
        config file); `config`: the whole config as JSON data (Config.model_dump(mode="json"))."""
        self.count, self.server, self.grace_s = count, server, supervisor.shutdown_grace_s
        self.run_dir, self.hub, self.config, self.clock = run_dir, hub, config, clock
        self.restarts = Restarts(supervisor.crash_loop)
        self.fronts = [Front(i) for i in range(count)]
        self.reserved: list[socket.socket] = []
        self.public: dict[str, str] = {}     # face -> the public address its fronts serve ("http://h:p", "h:p")
        self.config_file = os.path.join(run_dir, "fronts.json")
        self.stopping = False
        self.failure: str | None = None     # a front that died before its first HELLO at start-up
        self.on_hello: Callable[[], None] = lambda: None   # the lifecycle's: look again
        hub.on_hello = self._hello

    # ---- paths ---------------------------------------------------------------------------------

    def unix_path(self, face: str) -> str:
        """The broker's own face `face` ("http", "grpc") listens here; the fronts forward to it."""
        return os.path.join(self.run_dir, f"{face}.sock")

    # ---- start ---------------------------------------------------------------------------------

    def prepare(self, http: Any, grpc: Any, token_file: str | None, hub_address: str, max_reply_bytes: int,
                log_format: str) -> None:
        """Reserve the public ports and write the fronts' config file. `http`, `grpc`: the faces'
        declarations (None: off); `max_reply_bytes`: the workers' output arena (the gRPC send
        limit, as the broker's face has it); `log_format`: the broker's ("text", "json")."""
        faces: dict[str, Any] = {}
        for face, decl in (("http", http), ("grpc", grpc)):
            if decl is None:
                faces[face] = None
                continue
            sock = reserve_port(decl.host, decl.port, face)
            self.reserved.append(sock)
            port = sock.getsockname()[1]
            shown = f"[{decl.host}]:{port}" if ":" in decl.host else f"{decl.host}:{port}"
            self.public[face] = f"http://{shown}" if face == "http" else shown
            faces[face] = {"host": decl.host, "port": port, "broker": self.unix_path(face)}
        doc = {"config": self.config, "hub": hub_address, **faces,
               "token_file": os.path.abspath(token_file) if token_file else None, "broker_pid": os.getpid(),
               "max_reply_bytes": max_reply_bytes, "log_format": log_format}
        fd = os.open(self.config_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)

    def spawn_all(self) -> list[subprocess.Popen]:
        return [self._spawn(front) for front in self.fronts]

    def _spawn(self, front: Front) -> subprocess.Popen:
        front.proc = subprocess.Popen([sys.executable, "-m", "tgw.broker.fronts", "--run-dir", self.run_dir,
                                       "--index", str(front.index), "--config-json", self.config_file])
        front.hello, front.due_at = False, None
        self.restarts.spawned(front.index)
        log.info("front %d started (pid %d)", front.index, front.proc.pid,
                 extra={"event": "front_start", "index": front.index, "pid": front.proc.pid})
        return front.proc

    def _hello(self, index: int, pid: int) -> None:
        if 0 <= index < self.count:
            front = self.fronts[index]
            if front.proc is not None and front.proc.pid == pid:
                front.hello = True
                self.restarts.ready(index, self.clock())
                self.on_hello()

    def all_hello(self) -> bool:
        return all(front.hello for front in self.fronts)

    def startup_failure(self) -> str | None:
        """Why the start fails: a front that exited before its first HELLO during start-up."""
        for front in self.fronts:
            proc = front.proc
            if proc is not None and not front.hello and proc.poll() is not None:
                return (f"front process {front.index} (pid {proc.pid}) exited with code {proc.returncode} "
                        f"during start-up (its error is printed above)")
        return self.failure

    # ---- serving -------------------------------------------------------------------------------

    def watch(self, now: float, starting: bool) -> list[subprocess.Popen]:
        """One look: dead fronts' requests withdrawn (hub.end), each started again when its
        backoff is over (during start-up, one that never said HELLO fails the start instead:
        `failure`). The processes started now (to watch for their exits)."""
        started = []
        for front in self.fronts:
            proc = front.proc
            if proc is not None and proc.poll() is not None:
                if starting and not front.hello and self.failure is None:
                    self.failure = self.startup_failure()
                self._reap(front, proc, now)
            if self.failure is None and not self.stopping and front.proc is None and front.due_at is not None \
                    and now >= front.due_at:
                front.restarts += 1
                started.append(self._spawn(front))
        return started

    def _reap(self, front: Front, proc: subprocess.Popen, now: float) -> None:
        self.hub.end(front.index, proc.pid)
        code = proc.returncode
        front.last_death = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        front.proc, front.hello = None, False
        delay, benched = self.restarts.died(front.index, now)
        front.due_at = now + delay
        if self.failure is not None or self.stopping:
            return   # not started again: said by the start's failure, or the stop
        log.warning("front %d (pid %d) %s; starting again in %.1f s%s", front.index, proc.pid, front.last_death,
                    delay, f" ({benched} early deaths)" if benched else "",
                    extra={"event": "front_exit", "index": front.index, "pid": proc.pid, "code": code})

    def ready(self) -> bool:
        """Health: at least one front serves (none configured: nothing to wait for)."""
        return not self.fronts or any(front.hello for front in self.fronts)

    # ---- stop ----------------------------------------------------------------------------------

    async def stop(self) -> None:
        """DRAIN to every front, up to shutdown_grace_s for them to exit, then SIGTERM, then SIGKILL."""
        self.stopping = True
        live = [front.proc for front in self.fronts if front.proc is not None]
        try:
            if live:
                self.hub.drain_all()
                for front in self.fronts:   # not connected yet: no DRAIN reaches it, its SIGTERM drains it
                    if front.proc is not None and not front.hello and front.proc.poll() is None:
                        front.proc.send_signal(signal.SIGTERM)
                if not await self._exited(live, self.grace_s):
                    for proc in live:
                        if proc.poll() is None:
                            proc.send_signal(signal.SIGTERM)
                    if not await self._exited(live, TERM_WAIT_S):
                        for proc in live:
                            if proc.poll() is None:
                                log.warning("front pid %d did not stop: killed", proc.pid)
                                proc.kill()
                        for proc in live:
                            proc.wait()
        finally:
            for sock in self.reserved:
                sock.close()
            self.reserved.clear()

    @staticmethod
    async def _exited(procs: list[subprocess.Popen], within_s: float) -> bool:
        deadline = time.monotonic() + within_s
        while any(p.poll() is None for p in procs):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    def kill_now(self) -> None:
        """The broker leaves without a drain (a start-up that failed before the loop ran): SIGKILL."""
        for front in self.fronts:
            if front.proc is not None and front.proc.poll() is None:
                front.proc.kill()
                front.proc.wait()

    # ---- what status and /metrics show ----------------------------------------------------------

    def as_dict(self) -> dict:
        lives = []
        for front in self.fronts:
            life = self.hub.life(front.index)
            if front.proc is None:
                continue
            stats = life.stats if life is not None and life.pid == front.proc.pid else None
            lives.append({"index": front.index, "pid": front.proc.pid, "hello": front.hello,
                          "inflight": stats.inflight if stats else 0, "requests": stats.requests if stats else 0,
                          "forwarded": stats.forwarded if stats else 0, "gc": dict(stats.gc) if stats else {},
                          "region": dict(stats.region) if stats else {},
                          "restarts": front.restarts, "last_death": front.last_death})
        return {"configured": self.count, "alive": sum(1 for front in self.fronts if front.hello),
                "restarts": sum(front.restarts for front in self.fronts), "ready": self.ready(),
                "public": dict(self.public), "lives": lives}


def no_fronts() -> dict:
    """status' `fronts` without front processes (server.front_processes 0)."""
    return {"configured": 0, "alive": 0, "restarts": 0, "ready": True, "public": {}, "lives": []}
