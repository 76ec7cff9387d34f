"""Replies to callers under a budget per caller, so a reader that stops reading costs bounded memory.

libzmq keeps a peer's unsent messages inside this process; its high-water mark
(server.client_queue_messages) bounds their count, not their bytes. Large replies are therefore
sent zero-copy with a tracker that tells when libzmq is done with them (written to the socket,
or dropped with the peer), and a caller's unfinished large replies may not exceed
server.client_queue_bytes. A reply over either bound is dropped and counted; its caller learns
through its own timeout, as from a lost network.
"""
from __future__ import annotations

from collections import Counter, deque

from tgw.broker.state.complaints import Complaints
from .sockets import Pump

TRACK_MIN = 64 << 10  # smaller replies are copied by libzmq and bounded by the high-water mark alone


class Outbox:
    def __init__(self, pump: Pump, max_bytes: int, complaints: Complaints):
        self.pump, self.max_bytes, self.complaints = pump, max_bytes, complaints
        self.unsent: dict[bytes, deque] = {}   # caller -> (tracker, bytes) of large replies libzmq holds
        self.held: Counter = Counter()         # caller -> their bytes

    def send(self, ident: bytes, frames: list) -> bool:
        size = sum(map(len, frames))  # bytes, or byte-format memoryviews of the output arena
        if size < TRACK_MIN:
            why, _ = self.pump.send([ident, *frames])
        elif self.settle(ident) + size > self.max_bytes:
            why = "client_queue_bytes"
        else:
            # zero-copy: the message must own its bytes, as ring memory is reused once released
            why, tracker = self.pump.send([ident, *(f if isinstance(f, bytes) else bytes(f) for f in frames)],
                                          track=True)
            if not why:
                self.unsent.setdefault(ident, deque()).append((tracker, size))
                self.held[ident] += size
        if why:
            reason = {"full": "client_queue_messages", "gone": "client_gone"}.get(why, why)
            self.complaints.note("dropped", reason, "a reply was dropped: its caller is gone or not reading")
        return not why

    def settle(self, ident: bytes) -> int:
        """Forget the caller's large replies libzmq is done with; the bytes still held."""
        q = self.unsent.get(ident)
        while q and q[0][0].done:
            self.held[ident] -= q.popleft()[1]
        if not q:
            self.unsent.pop(ident, None)
            self.held.pop(ident, None)
            return 0
        return self.held[ident]

    def settle_all(self) -> None:
        for ident in list(self.unsent):
            self.settle(ident)
