"""run_broker: the broker process's one entry function - it only wires things together.

Order: title, sockets, rings (sweeping stale ones), signals, then the lifecycle: spawn
workers, wait for their ready handshake, serve until SIGTERM/SIGINT, drain; finally stop
workers, unlink rings, close sockets and remove their files.
"""
from __future__ import annotations

import asyncio
import logging
import signal

import setproctitle
import uvloop
import zmq

from tgw.shm.paths import default_address
from tgw.shm.segment import ShmError

from .config import Config
from .endpoints import StartupError, backend_address, bind, remove_socket_files
from .lifecycle import Lifecycle
from .server import Broker
from .supervisor import Supervisor

log = logging.getLogger("tgw.broker")


async def serve(cfg: Config, address: str) -> None:
    backend = backend_address(address)
    ctx = zmq.Context()
    supervisor = Supervisor(cfg.workers, cfg.supervisor, backend)
    broker = Broker(cfg)
    lifecycle = Lifecycle(broker, supervisor, cfg)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lifecycle.on_stop_signal)
    loop.add_signal_handler(signal.SIGUSR1, lifecycle.on_snapshot_signal)
    front = bind(ctx, address, public=True)  # refuses first if a live broker has the address
    try:
        broker.attach(loop, front, bind(ctx, backend, public=False))
        try:
            swept = supervisor.prepare()
        except ShmError as exc:
            raise StartupError(str(exc)) from None
        if swept:
            log.warning("swept %d stale segment(s) of dead processes: %s", len(swept), ", ".join(swept))
        try:
            await lifecycle.run(address)
        finally:
            lifecycle.shutdown()
            broker.front.close()
            broker.back.close()
    finally:
        ctx.destroy(linger=0)
        remove_socket_files(address, backend)


def run_broker(cfg: Config, address: str | None = None) -> int:
    setproctitle.setproctitle("tgw-broker")  # what ps and top show
    try:
        uvloop.run(serve(cfg, address or cfg.server.address or default_address()))
    except StartupError as exc:
        log.error("start-up failed: %s", exc)
        return 1
    return 0
