"""run_broker: the broker process's one entry function - it only wires things together.

Order: bind sockets, make rings, spawn workers, wait for their ready handshake (watching
them), serve until SIGTERM/SIGINT, then finish in-flight work, stop workers, unlink rings.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time

import uvloop
import zmq

from tgw.shm.paths import default_address, ipc_path

from .config import Config
from .server import Broker
from .supervisor import Supervisor
from .systemd import sd_notify

log = logging.getLogger("tgw.broker")
STOP_DRAIN_S = 30.0
MONITOR_S = 0.05
WATCHDOG_S = 1.0  # systemd's WatchdogSec is tens of seconds: one ping a second is plenty


class StartupError(RuntimeError):
    pass


def _prepare_ipc(address: str) -> None:
    """Create the socket's directory (0750); refuse if a live broker already listens there."""
    path = ipc_path(address)
    if path is None:
        return
    os.makedirs(os.path.dirname(path), mode=0o750, exist_ok=True)
    if os.path.exists(path):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
            raise StartupError(f"another broker is already listening on {address}")
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(path)  # left by a broker that died
        finally:
            probe.close()


def _bind(ctx: zmq.Context, address: str, kind: int, public: bool) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)   # a send to a vanished peer errors instead of vanishing
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    sock.bind(address)
    path = ipc_path(address)
    if path:
        os.chmod(path, 0o660 if public else 0o600)
    return sock


class BrokerProcess:
    def __init__(self, cfg: Config, address: str):
        self.cfg, self.address = cfg, address
        self.ctx = zmq.Context()
        run_dir = os.path.dirname(ipc_path(address) or f"/tmp/tgw-{os.geteuid()}/x")
        self.backend = f"ipc://{run_dir}/tgw-{os.getpid()}.w.sock"
        self.supervisor = Supervisor(cfg.workers, self.backend)
        self.broker = Broker(cfg, self.supervisor)
        self.stop_event: asyncio.Event | None = None

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self.stop_event = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop_event.set)
        _prepare_ipc(self.address)
        os.makedirs(os.path.dirname(ipc_path(self.backend)), mode=0o750, exist_ok=True)
        front = _bind(self.ctx, self.address, zmq.ROUTER, public=True)
        back = _bind(self.ctx, self.backend, zmq.ROUTER, public=False)
        swept = self.supervisor.prepare()
        if swept:
            log.warning("swept %d stale segment(s) of dead processes: %s", len(swept), ", ".join(swept))
        self.broker.attach(loop, front, back)
        monitor = None
        try:
            self.supervisor.spawn_all()
            for w in self.supervisor.workers:
                self.broker.by_identity[w.identity] = w
            monitor = asyncio.create_task(self._monitor())
            if not await self._wait_ready():
                log.info("stopped during start-up")
                return
            self.broker.started = True
            log.info("serving on %s with %d worker(s)", self.address, len(self.supervisor.workers))
            sd_notify(f"READY=1\nSTATUS=serving on {self.address}")
            await self.stop_event.wait()
            sd_notify("STOPPING=1")
            await self._drain()
        finally:
            if monitor is not None:
                monitor.cancel()
            self.broker.stopping = True
            self.broker.stop_workers()
            self.supervisor.stop()
            self.broker.front.close()
            self.broker.back.close()
            self.ctx.term()
            for addr in (self.address, self.backend):
                path = ipc_path(addr)
                if path and os.path.exists(path):
                    os.unlink(path)

    async def _wait_ready(self) -> bool:
        """True once every worker is ready; False if asked to stop first; raises on failure."""
        deadline = time.monotonic() + self.cfg.workers.start_timeout_s
        while not all(w.state == "ready" for w in self.supervisor.workers):
            if self.broker.startup_failure:
                raise StartupError(self.broker.startup_failure)
            dead = [w for w in self.supervisor.workers if w.state == "dead"]
            if dead:
                w = dead[0]
                raise StartupError(f"{w.name} exited with code {w.proc.returncode} during start-up "
                                   "(its error is printed above)")
            if time.monotonic() > deadline:
                raise StartupError(f"workers not ready after {self.cfg.workers.start_timeout_s:.0f}s")
            if self.stop_event.is_set():
                return False
            await asyncio.sleep(0.02)
        return True

    async def _monitor(self) -> None:
        """Notice dead workers, hand their work back, restart them with backoff; sweep deadlines."""
        starting, last_ping = True, 0.0
        while True:
            await asyncio.sleep(MONITOR_S)
            self.broker.sweep_deadlines()
            starting = starting and not all(w.state == "ready" for w in self.supervisor.workers)
            for w in self.supervisor.dead():
                self.broker.worker_lost(w)
                if not starting and not self.broker.stopping:
                    self.supervisor.replace(w)
            for w in self.supervisor.due_restarts():
                self.broker.by_identity[w.identity] = w
            if self.broker.started and time.monotonic() - last_ping >= WATCHDOG_S:
                last_ping = time.monotonic()
                sd_notify("WATCHDOG=1")

    async def _drain(self) -> None:
        """Finish queued and in-flight work (new requests are refused meanwhile)."""
        self.broker.stopping = True
        deadline = time.monotonic() + STOP_DRAIN_S
        while self.broker.busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)


def run_broker(cfg: Config, address: str | None = None) -> int:
    address = address or cfg.server.address or default_address()
    proc = BrokerProcess(cfg, address)
    try:
        uvloop.run(proc.run())
    except StartupError as exc:
        log.error("start-up failed: %s", exc)
        return 1
    return 0
