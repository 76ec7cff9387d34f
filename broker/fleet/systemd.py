"""sd_notify without libsystemd: one datagram to $NOTIFY_SOCKET (a no-op outside systemd)."""
from __future__ import annotations

import os
import socket


def sd_notify(state: str) -> bool:
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]  # abstract namespace
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        try:
            s.sendto(state.encode(), addr)
        except OSError:
            return False
    return True
