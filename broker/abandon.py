"""Requests nobody waits for any more: cancelled by their caller, left by a caller closing, or
left by a caller whose process is gone.

A queued request that nobody waits for would still take a batch slot and compute, so it is
taken out of its queue unrun and counted (stats `abandoned`, by reason). A request already
on a worker runs to its end; if its caller is gone, the outbox drops its reply.

Who is gone: ZeroMQ hides connections behind the ROUTER, and its monitor names a closed
connection by file descriptor only. An ipc caller's process is known from the peer
credentials libzmq attaches to each message ('Peer-Address' ends ':uid:gid:pid'), read once
per new caller. Whenever the monitor has seen a disconnect, the processes of the callers that
are owed requests are looked up (pid and start time, against pid reuse): the queued requests
of the dead ones are dropped. tcp:// callers have no pid: a vanished one's requests end at
their deadlines (its connection is closed by ZeroMQ heartbeats, docs/PROTOCOL.md section 6b).
"""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, NamedTuple

import psutil

from tgw.shm.wire import PROTOCOL_VERSION, Cancel, CancelReply, Goodbye

from .pending import Pending

if TYPE_CHECKING:
    from .frontdoor import FrontDoor

MAX_CANCEL_IDS = 4096   # ids one cancel may name (more are ignored: a header is bounded anyway)
RECHECK_S = 2.0         # after a disconnect, look again on every tick this long: the socket closes while
                        # the process is still ending


class Peer(NamedTuple):
    uid: int
    gid: int
    pid: int


def peer_credentials(frame) -> Peer | None:
    """The uid, gid and pid of the process that sent `frame` over ipc://; None over tcp://."""
    try:
        address = frame.get("Peer-Address")
    except Exception:  # a frame that is not a ZeroMQ message (a test's bytes), or no metadata
        return None
    # libzmq writes "localhost:uid:gid:pid" for a unix socket; a tcp peer's address is numeric
    parts = address.split(":") if isinstance(address, str) else ()
    if len(parts) != 4 or parts[0] != "localhost" or not all(p.isdigit() for p in parts[1:]):
        return None
    return Peer(int(parts[1]), int(parts[2]), int(parts[3]))


def process_start(pid: int) -> float | None:
    """When process `pid` started (None: no such process, or one that has ended and is waiting to
    be reaped): a pid and its start time name one process."""
    try:
        p = psutil.Process(pid)
        return None if p.status() == psutil.STATUS_ZOMBIE else p.create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return None


class Abandonment:
    def __init__(self, door: "FrontDoor"):
        self.door, self.b = door, door.b
        self.inflight: dict[tuple, Pending] = {}        # (caller, request id) -> admitted, unanswered
        self.processes: dict[bytes, tuple[int, float]] = {}   # ipc caller -> (pid, start time)
        self.counts: Counter = Counter()                # reason -> queued requests dropped unrun
        self._disconnects_seen = 0
        self._recheck_until = 0.0
        self.b.admission.on_finished.append(self.finished)

    # ---- bookkeeping (hot path) ----------------------------------------------------------------

    def track(self, p: Pending) -> None:
        self.inflight[p.client, p.req_id] = p

    def finished(self, p: Pending, code: str | None, now: float) -> None:
        key = (p.client, p.req_id)
        if self.inflight.get(key) is p:   # an id reused while in flight must not drop the other's entry
            del self.inflight[key]

    def meet(self, ident: bytes, header_frame) -> None:
        """A caller's first message: remember its process, when it has one on this host."""
        peer = peer_credentials(header_frame)
        if peer is not None:
            start = process_start(peer.pid)
            if start is not None:
                self.processes[ident] = (peer.pid, start)

    # ---- the three ways a request is abandoned -------------------------------------------------

    def handle(self, ident, msg: Cancel | Goodbye) -> None:
        if isinstance(msg, Goodbye):
            self.drop_caller({ident}, "client_closed")
            self.processes.pop(ident, None)
            return
        cancelled = running = 0
        queued = []
        for req_id in msg.ids[:MAX_CANCEL_IDS]:
            p = self.inflight.get((ident, req_id))
            if p is None:
                continue  # answered already, or never admitted
            if self.b.batcher.remove(p):
                queued.append(p)
            else:
                running += 1
        self._drop(queued, "cancelled")
        cancelled = len(queued)
        self.door.reply(ident, CancelReply(v=PROTOCOL_VERSION, id=msg.id, cancelled=cancelled, running=running))

    def drop_caller(self, idents: set, reason: str) -> int:
        """Take every queued request of these callers out, unrun; how many."""
        taken = self.b.batcher.take_where(lambda p: p.client in idents)
        self._drop(taken, reason)
        return len(taken)

    def sweep(self, now: float) -> None:
        """After a disconnect (and on every tick for RECHECK_S after one): drop the queued requests
        of callers whose process is gone."""
        disconnects = self.door.callers.disconnects
        if disconnects != self._disconnects_seen:
            self._disconnects_seen = disconnects
            self._recheck_until = now + RECHECK_S
        elif now > self._recheck_until:
            return
        owed = self.door.callers.owed
        gone = {ident for ident, (pid, start) in self.processes.items()
                if ident in owed and process_start(pid) != start}
        served = self.door.callers.served
        for ident in [i for i in self.processes if i in gone or i not in served]:
            del self.processes[ident]   # the dead, and callers forgotten as idle
        if gone:
            self.drop_caller(gone, "client_gone")

    def _drop(self, requests: list[Pending], reason: str) -> None:
        if not requests:
            return
        now = self.b.clock()
        for p in requests:
            self.door.callers.paid(p.client)
            self.b.admission.finished(p, "ABANDONED", now)
        self.counts[reason] += len(requests)
        self.b.schedule()   # room in the queues, and an adaptive limit that may let more in
