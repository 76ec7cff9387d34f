"""One generation as the broker keeps it, from its dispatch to its end (pure): its request, the
worker running it, the outputs sent (kept, bounded by its max_outputs, for a resumption), the
replies its caller has not read yet, its timings.

Phases: `admitting` (its admission batch is on a worker, not yet answered by the worker's Done),
`running` (in the worker's loop), `queued` (re-queued after its worker died). `closed` once
its caller is answered (an end, an error, a cancel): the record stays until the worker says
the sequence ended, so its slot counts as taken until it is free."""
from __future__ import annotations

from collections import deque

from tgw.shm.wire import GenSeq

ADMITTING, RUNNING, QUEUED = "admitting", "running", "queued"


class Stream:
    __slots__ = ("p", "seq", "phase", "worker", "key", "batch_id", "closed", "sent", "kept", "first_at", "last_at",
                 "resumed", "unread", "read", "sent_bytes", "read_bytes", "tracked_at")

    def __init__(self, p, outputs: list):
        self.p = p                       # its Pending (state/pending.py); p.generate is its GenSeq
        self.seq: int = p.generate.seq
        self.phase = QUEUED
        self.worker = None               # the WorkerHandle running it (admitting or running)
        self.key = ""                    # model:version on that worker
        self.batch_id = 0                # its admission batch (admitting)
        self.closed = False              # its caller is answered: nothing more is sent
        self.sent = 0                    # outputs sent to the caller (the next position expected)
        self.kept = {t.name: bytearray() for t in outputs}   # each declared output's rows sent, in order
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.resumed = 0                 # prefills again after its worker died
        # the caller's reading: (zmq tracker, outputs sent, bytes sent) as of each tracked reply
        # libzmq may still hold; outputs and bytes of the replies libzmq is done with
        self.unread: deque = deque()
        self.read = self.sent_bytes = self.read_bytes = 0
        self.tracked_at = -1 << 62       # outputs sent as of the last tracked reply

    @property
    def gen(self) -> GenSeq:
        return self.p.generate

    def on(self, worker, key: str, batch_id: int) -> None:
        """Its admission batch went to `worker`."""
        self.phase, self.worker, self.key, self.batch_id = ADMITTING, worker, key, batch_id

    def requeued(self) -> None:
        """Its worker died: prefilled again elsewhere with the outputs sent appended."""
        self.phase, self.worker, self.batch_id = QUEUED, None, 0
        self.resumed += 1
        gen = self.p.generate
        gen.delivered = self.sent
        gen.prefix = [bytes(b) for b in self.kept.values()]

    def went_out(self, n: int, nbytes: int, tracker) -> None:
        """A reply of n outputs went out; `tracker` (None: untracked) tells when libzmq is done with it."""
        self.sent += n
        self.sent_bytes += nbytes
        if tracker is not None:
            self.unread.append((tracker, self.sent, self.sent_bytes))
            self.tracked_at = self.sent

    def held(self) -> tuple[int, int]:
        """Outputs, and their bytes, in replies libzmq may still hold (the caller has not taken
        them): replies leave in order, so a tracked one done says every one before it is too;
        those after the newest done one count as held (an overcount of at most one tracking step)."""
        q = self.unread
        while q and q[0][0].done:
            _, self.read, self.read_bytes = q.popleft()
        return self.sent - self.read, self.sent_bytes - self.read_bytes
