"""Requests nobody waits for any more: cancelled by their caller (a native `cancel`), left by a
caller closing (`bye`, an HTTP connection closed, a gRPC call cancelled or past its deadline:
the faces call `drop_caller`), or left by a caller whose process is gone.

Each is withdrawn wherever it is, and never answered (a generation in its worker's loop is ended
there at the next step: broker/generate/streams.py). A queued one is taken out of its queue
unrun (stats `abandoned`, by reason). One already on a worker (its batch staged or computing)
is taken out of its batch by the core (`withdraw`: state/inflight.py): a worker that has not
launched the batch leaves it out, else its rows are computed and dropped; which of the two
happened is known at the batch's completion (core/serving.py). A pipeline's run stops: none
of its steps still to come is sent, and its steps in flight are withdrawn in turn. Every
withdrawn request is counted by model and where (`cancelled`: queued, staged, computing,
pipeline, generating - a generation in its worker's loop; /metrics
tgw_requests_cancelled_total) and leaves the broker's accounts at once (its caller's cap, its
tenant, code ABANDONED).

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


def _nobody(wanted) -> list:
    return []


class Abandonment:
    def __init__(self, batcher, callers, finished: Callable, schedule: Callable[[], None],
                 clock: Callable[[], float], reply: Callable, withdraw: Callable = _nobody):
        # batcher: its queues (remove, take_where); finished: a request leaves (admission's accounting);
        # withdraw(wanted): the requests on workers that `wanted(p)` picks, taken out of their batches
        self.batcher, self.callers, self.finished_by, self.schedule = batcher, callers, finished, schedule
        self.clock, self.reply, self.withdraw = clock, reply, withdraw
        self.inflight: dict[tuple, Pending] = {}        # (caller, request id) -> admitted, unanswered
        self.processes: dict[bytes, tuple[int, float]] = {}   # ipc caller -> (pid, start time)
        self.counts: Counter = Counter()                # reason -> queued requests dropped unrun
        self.cancelled: Counter = Counter()             # (model, where) -> requests withdrawn
        self._disconnects_seen = 0
        self.runs = None   # pipeline.executor.Pipelines (the door sets it): their runs stop with their callers
        self.streams = None   # generate.streams.Streams (the door sets it): running generations end with them
        self._recheck_until = 0.0

    # ---- bookkeeping (hot path) ----------------------------------------------------------------

    def track(self, p: Pending) -> None:
        self.inflight[p.client, p.req_id] = p

    def finished(self, ps: list[Pending], code: str | None, now: float) -> None:
        inflight = self.inflight
        for p in ps:
            key = (p.client, p.req_id)
            if inflight.get(key) is p:   # an id reused while in flight must not drop the other's entry
                del inflight[key]

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
        ids = msg.ids[:MAX_CANCEL_IDS]
        queued, running, generating = [], set(), 0
        for req_id in ids:
            p = self.inflight.get((ident, req_id))
            if p is None:
                continue  # answered already, never admitted, or a pipeline's run (below)
            if self.batcher.remove(p):
                queued.append(p)
            elif p.generate is not None and self.streams is not None and self.streams.cancel(p):
                generating += 1   # in its worker's loop: ended at the next step
                self.cancelled[p.model, "generating"] += 1
            else:
                running.add(id(p))
        self._drop(queued, "cancelled")
        on_workers = self._withdraw_running(lambda p: id(p) in running) if running else 0
        stopped = self._stop_runs([(ident, i) for i in ids], lambda: self.runs.cancel(ident, ids))
        if stopped:   # a pipeline's run: none of its steps still to come is sent
            self.counts["cancelled"] += stopped
        self.reply(ident, CancelReply(v=PROTOCOL_VERSION, id=msg.id, cancelled=len(queued) + stopped,
                                      running=on_workers + generating))

    def drop_caller(self, idents: set, reason: str) -> int:
        """Withdraw every request of these callers (they gave up or are gone): queued, on a
        worker, or a pipeline's run; how many."""
        runs = self.runs is not None and bool(self.runs.runs)
        return self._drop_where(lambda p: p.client in idents, reason,
                                [key for key in self.runs.runs if key[0] in idents] if runs else [],
                                lambda: self.runs.drop(idents))

    def drop_ids(self, ident, ids: list, reason: str) -> int:
        """Withdraw these requests of one caller (`reason`: why its callers gave up), wherever
        they are, unanswered - a front process's callers (broker/fronts/hub.py), as drop_caller
        does a face's caller's; how many."""
        keys = {(ident, i) for i in ids[:MAX_CANCEL_IDS]}
        runs = self.runs is not None and bool(self.runs.runs)
        return self._drop_where(lambda p: (p.client, p.req_id) in keys, reason,
                                [key for key in keys if key in self.runs.runs] if runs else [],
                                lambda: self.runs.cancel(ident, [i for _, i in keys]))

    def _drop_where(self, wanted: Callable, reason: str, run_keys: list, stop_runs: Callable[[], int]) -> int:
        taken = self.batcher.take_where(wanted)
        self._drop(taken, reason)
        on_workers = self._withdraw_running(wanted)
        if self.streams is not None:
            for p in self.streams.drop(wanted):
                self.cancelled[p.model, "generating"] += 1
                on_workers += 1
        stopped = self._stop_runs(run_keys, stop_runs) if run_keys else 0
        if stopped:
            self.counts[reason] += stopped
        return len(taken) + on_workers + stopped

    def withdrawn(self, model: str, where: str, n: int = 1) -> None:
        """Count `n` withdrawn requests of `model` by where they were (the core tells, for those on
        workers, once their batch's completion says)."""
        self.cancelled[model, where] += n

    def cancelled_by_model(self) -> dict[str, dict[str, int]]:
        """model -> where -> requests withdrawn (stats `cancelled`)."""
        out: dict[str, dict[str, int]] = {}
        for (model, where), n in self.cancelled.items():
            out.setdefault(model, {})[where] = n
        return out

    def _withdraw_running(self, wanted) -> int:
        """Take the requests `wanted` picks out of the batches on workers; they leave the broker's
        accounts now (their answers will be dropped): how many."""
        taken = self.withdraw(wanted)
        if taken:
            now = self.clock()
            for p in taken:
                p.take_back()   # its latency is nobody's: the breaker and latency figures skip it
                self.finished_by(p, "ABANDONED", now)
            self.schedule()
        return len(taken)

    def _stop_runs(self, keys: list, stop: Callable[[], int]) -> int:
        """Stop the pipeline runs of these (caller, id) keys by `stop()`, counted by pipeline."""
        if self.runs is None:
            return 0
        names = [run.plan.name for key in keys if (run := self.runs.runs.get(key)) is not None]
        stopped = stop()
        for name in names:
            self.cancelled[name, "pipeline"] += 1
        return stopped

    def sweep(self, now: float) -> None:
        """After a disconnect (and on every tick for RECHECK_S after one): drop the queued requests
        of callers whose process is gone."""
        disconnects = self.callers.disconnects
        if disconnects != self._disconnects_seen:
            self._disconnects_seen = disconnects
            self._recheck_until = now + RECHECK_S
        elif now > self._recheck_until:
            return
        owed = self.callers.owed.by_caller
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
            self.cancelled[p.model, "queued"] += 1
        self.counts[reason] += len(requests)
        self.schedule()   # room in the queues, and an adaptive limit that may let more in
