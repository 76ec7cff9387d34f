"""The broker's two sockets: the clients' front door and the workers' back door.

ipc:// paths get a 0750 directory; the front socket is 0660 (callers in the broker's group),
the back socket 0600 (workers run as the broker's user). A stale socket file left by a dead
broker is replaced; a live broker on the same path is refused.
"""
from __future__ import annotations

import os
import socket

import zmq

from tgw.shm.paths import ipc_path, runtime_dir


class StartupError(RuntimeError):
    """Start-up cannot go on; the message says why (no traceback is printed)."""


def backend_address(front: str) -> str:
    """The workers' socket: beside an ipc front socket, else in the runtime directory."""
    path = ipc_path(front)
    run_dir = os.path.dirname(path) if path else runtime_dir()
    return f"ipc://{run_dir}/tgw-{os.getpid()}.w.sock"


def prepare_ipc(address: str) -> None:
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


def bind(ctx: zmq.Context, address: str, public: bool) -> zmq.Socket:
    prepare_ipc(address)
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)   # a send to a vanished peer errors instead of vanishing
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    sock.bind(address)
    path = ipc_path(address)
    if path:
        os.chmod(path, 0o660 if public else 0o600)
    return sock


def remove_socket_files(*addresses: str) -> None:
    for addr in addresses:
        path = ipc_path(addr)
        if path and os.path.exists(path):
            os.unlink(path)
