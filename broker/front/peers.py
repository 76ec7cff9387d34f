"""Who sent a message on the front socket, from the metadata libzmq attaches to it.

Over ipc:// libzmq writes the peer's credentials as Peer-Address "localhost:uid:gid:pid" (some
versions leave the host empty); over tcp:// it is the peer's IP address; inproc:// carries no
Peer-Address (reading it raises). The HTTP face passes no frame at all. One parser for every
caller of these facts: abandonment and regions (the pid) and CUDA routing (same box or not).
"""
from __future__ import annotations

from typing import NamedTuple

import psutil


class Peer(NamedTuple):
    uid: int
    gid: int
    pid: int


_NO_METADATA = object()   # not a ZeroMQ frame (None from the HTTP face, a test's bytes)
_INPROC = object()        # a ZeroMQ frame without a peer address: this very process


def _address(frame):
    get = getattr(frame, "get", None)
    if get is None:
        return _NO_METADATA
    try:
        return get("Peer-Address")
    except Exception:  # zmq.ZMQError(EINVAL): inproc carries no peer address
        return _INPROC


def peer_credentials(frame) -> Peer | None:
    """The uid, gid and pid of the process that sent `frame` over ipc://; None otherwise."""
    address = _address(frame)
    parts = address.split(":") if isinstance(address, str) else ()
    if len(parts) != 4 or parts[0] not in ("", "localhost") or not all(p.isdigit() for p in parts[1:]):
        return None
    return Peer(int(parts[1]), int(parts[2]), int(parts[3]))


def is_local(frame) -> bool:
    """Whether `frame` came from a process on this box: ipc:// or inproc://."""
    return _address(frame) is _INPROC or peer_credentials(frame) is not None


def process_start(pid: int) -> float | None:
    """When process `pid` started (None: no such process, or one that has ended and is waiting to
    be reaped): a pid and its start time name one process."""
    try:
        p = psutil.Process(pid)
        return None if p.status() == psutil.STATUS_ZOMBIE else p.create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return None
