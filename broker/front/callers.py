"""The callers connected to the front socket: how many, which ones are served; what each is owed
is admission's count (sched/admission.py Owed), held here beside them.

ZeroMQ hides connections behind a ROUTER, so they are counted from its monitor events. Past
`max_clients` a caller that has not been served before is answered OVERLOADED (reason
too_many_clients) on every message; past `max_clients` plus a headroom a new connection is
denied by the ZAP handler, so libzmq closes it right after accept() and nobody can pile up
descriptors (libzmq aborts the process when accept() meets EMFILE). The open-file limit is
raised to the hard limit at start, and max_clients shrunk (with a warning) when the
descriptors left could not hold that many callers plus the headroom.
"""
from __future__ import annotations

import logging
import resource
from typing import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from tgw.shm.errors import Code, fail

from tgw.broker.config.schema import ServerDecl
from tgw.broker.sched.admission import Owed

log = logging.getLogger("tgw.broker")
EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
RESERVED_FDS = 128        # the broker's own files: sockets to workers, /proc reads, snapshots, logs
FDS_PER_WORKER = 8        # its pipe, ring, socket and the supervisor's handles on it


def raise_fd_limit() -> int:
    """Soft open-file limit raised to the hard one; returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft


def headroom(max_clients: int) -> int:
    """Connections accepted past max_clients (to tell them why) before the listener closes."""
    return max(16, max_clients // 4)


def fit_max_clients(wanted: int, fd_limit: int, workers: int) -> int:
    """The most callers the descriptors allow (each holds one), with room for the broker's own."""
    room = fd_limit - RESERVED_FDS - FDS_PER_WORKER * workers
    fits = max(1, int(room / 1.25) - 16)  # max_clients + headroom(max_clients) <= room
    if wanted > fits:
        log.warning("server.max_clients %d does not fit the open-file limit %d (raise LimitNOFILE); "
                    "serving at most %d callers", wanted, fd_limit, fits)
        return fits
    return wanted


class Callers:
    def __init__(self, server: ServerDecl, max_clients: int, clock: Callable[[], float]):
        self.max_clients, self.clock = max_clients, clock
        self.close_at = max_clients + headroom(max_clients)
        self.connected = 0
        self.served: dict[bytes, float] = {}   # callers let in -> when last seen
        self.owed = Owed(server.max_inflight_per_client)   # requests admitted and not yet answered, per caller
        self.denied = 0                        # connections closed at the handshake (past the headroom)
        self.disconnects = 0                   # connections closed, ever (abandon.py looks after each)

    # ---- connections -------------------------------------------------------------------------

    def on_monitor(self, frames: list) -> None:
        event = parse_monitor_message(frames)["event"]
        if event == zmq.EVENT_ACCEPTED:
            self.connected += 1
        elif event == zmq.EVENT_DISCONNECTED:
            self.connected = max(0, self.connected - 1)
            self.disconnects += 1

    def zap(self, frames: list) -> list:
        """The ZAP reply to a new connection: allowed while the count is within the headroom past
        max_clients; past it, denied, so libzmq closes it at once and its descriptor comes back."""
        request_id = frames[3]
        if self.connected <= self.close_at:
            return [*frames[:2], b"1.0", request_id, b"200", b"OK", b"", b""]
        self.denied += 1
        return [*frames[:2], b"1.0", request_id, b"400", b"too many callers", b"", b""]

    def let_in(self, ident: bytes) -> None:
        """Raise OVERLOADED for a caller not served before while more than max_clients are connected."""
        if ident in self.served:
            self.served[ident] = self.clock()
            return
        if self.connected > self.max_clients:
            raise fail(Code.OVERLOADED, f"too many callers: {self.connected} connected, server.max_clients is "
                       f"{self.max_clients}; try again later", reason="too_many_clients",
                       max_clients=self.max_clients)
        self.served[ident] = self.clock()
        if len(self.served) > 2 * self.max_clients:
            self._forget_idle()

    def _forget_idle(self) -> None:
        """Drop the longest-idle half: gone callers leave no trace in the monitor events, and a live
        one forgotten here is let in again by the count alone."""
        keep = sorted(self.served.items(), key=lambda kv: kv[1])[len(self.served) // 2:]
        self.served = dict(keep)
