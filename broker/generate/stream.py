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
                 "resumed", "unread", "unread_n", "unread_bytes")

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
        self.unread: deque = deque()     # (zmq tracker, outputs, bytes) of replies libzmq still holds
        self.unread_n = self.unread_bytes = 0   # their sums

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

    def sent_unread(self, tracker, n: int, nbytes: int) -> None:
        """A reply of n outputs went out; `tracker` tells when libzmq is done with it."""
        self.unread.append((tracker, n, nbytes))
        self.unread_n += n
        self.unread_bytes += nbytes

    def held(self) -> tuple[int, int]:
        """Outputs, and their bytes, in replies libzmq still holds (the caller has not taken them):
        they leave in order, so the oldest done ones are forgotten first."""
        q = self.unread
        while q and q[0][0].done:
            _, n, nbytes = q.popleft()
            self.unread_n -= n
            self.unread_bytes -= nbytes
        return self.unread_n, self.unread_bytes
