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
from typing import Callable

from tgw.shm.wire import PROTOCOL_VERSION, Cancel, CancelReply, Goodbye

from tgw.broker.state.pending import Pending

from .peers import peer_credentials, process_start

MAX_CANCEL_IDS = 4096   # ids one cancel may name (more are ignored: a header is bounded anyway)
RECHECK_S = 2.0         # after a disconnect, look again on every tick this long: the socket closes while
                        # the process is still ending


class Abandonment:
    def __init__(self, batcher, callers, finished: Callable, schedule: Callable[[], None],
                 clock: Callable[[], float], reply: Callable):
        # batcher: its queues (remove, take_where); finished: a request leaves (admission's accounting)
        self.batcher, self.callers, self.finished_by, self.schedule = batcher, callers, finished, schedule
        self.clock, self.reply = clock, reply
        self.inflight: dict[tuple, Pending] = {}        # (caller, request id) -> admitted, unanswered
        self.processes: dict[bytes, tuple[int, float]] = {}   # ipc caller -> (pid, start time)
        self.counts: Counter = Counter()                # reason -> queued requests dropped unrun
        self._disconnects_seen = 0
        self.runs = None   # pipeline.executor.Pipelines (the door sets it): their runs stop with their callers
        self._recheck_until = 0.0

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

    def goodbye(self, ident, msg: Goodbye) -> None:
        self.drop_caller({ident}, "client_closed")
        self.processes.pop(ident, None)

    def cancel(self, ident, msg: Cancel) -> None:
        running = 0
        queued = []
        for req_id in msg.ids[:MAX_CANCEL_IDS]:
            p = self.inflight.get((ident, req_id))
            if p is None:
                continue  # answered already, never admitted, or a pipeline's run (below)
            if self.batcher.remove(p):
                queued.append(p)
            else:
                running += 1
        self._drop(queued, "cancelled")
        stopped = self.runs.cancel(ident, msg.ids[:MAX_CANCEL_IDS]) if self.runs is not None else 0
        if stopped:   # a pipeline's run: none of its steps still to come is sent
            self.counts["cancelled"] += stopped
        self.reply(ident, CancelReply(v=PROTOCOL_VERSION, id=msg.id, cancelled=len(queued) + stopped,
                                      running=running))

    def drop_caller(self, idents: set, reason: str) -> int:
        """Take every queued request of these callers out, unrun; how many."""
        taken = self.batcher.take_where(lambda p: p.client in idents)
        self._drop(taken, reason)
        stopped = self.runs.drop(idents) if self.runs is not None and self.runs.runs else 0
        if stopped:
            self.counts[reason] += stopped
        return len(taken) + stopped

    def sweep(self, now: float) -> None:
        """After a disconnect (and on every tick for RECHECK_S after one): drop the queued requests
        of callers whose process is gone."""
        disconnects = self.callers.disconnects
        if disconnects != self._disconnects_seen:
            self._disconnects_seen = disconnects
            self._recheck_until = now + RECHECK_S
        elif now > self._recheck_until:
            return
        owed = self.callers.owed
        gone = {ident for ident, (pid, start) in self.processes.items()
                if ident in owed and process_start(pid) != start}
        served = self.callers.served
        for ident in [i for i in self.processes if i in gone or i not in served]:
            del self.processes[ident]   # the dead, and callers forgotten as idle
        if gone:
            self.drop_caller(gone, "client_gone")

    def _drop(self, requests: list[Pending], reason: str) -> None:
        if not requests:
            return
        now = self.clock()
        for p in requests:
            self.finished_by(p, "ABANDONED", now)
        self.counts[reason] += len(requests)
        self.schedule()   # room in the queues, and an adaptive limit that may let more in
