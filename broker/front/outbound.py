"""Replies on their way out: a request's outputs as its reply carries them, and the sending of
replies to callers under a budget per caller.

Frames are lz4-compressed when the request asked (all of them for `compress_outputs: true`; for
"auto", those tgw.shm.compression's rule picks, the rule the client applies to its inputs).

A reader that stops reading costs bounded memory: libzmq keeps a peer's unsent messages inside
this process; its high-water mark (server.client_queue_messages) bounds their count, not their
bytes. Large replies are therefore sent zero-copy with a tracker that tells when libzmq is done
with them (written to the socket, or dropped with the peer), and a caller's unfinished large
replies may not exceed server.client_queue_bytes. A reply over either bound is dropped and
counted; its caller learns through its own timeout, as from a lost network.
"""
from __future__ import annotations

from collections import Counter, deque

import lz4.frame

from tgw.shm.compression import worth_compressing
from tgw.shm.wire import TensorMeta

from tgw.broker.state.complaints import Complaints
from tgw.broker.state.pending import Pending
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


def _lz4_len(part: memoryview) -> int:
    return len(lz4.frame.compress(part))


def packed(compress, raw) -> tuple[object, str | None]:
    """One output's frame and its `compression`: `raw` (a bytes view) as it is, or its lz4 frame."""
    if compress is True:
        return lz4.frame.compress(raw), "lz4"
    if compress == "auto":
        view = memoryview(raw).cast("B") if not isinstance(raw, memoryview) or raw.format != "B" else raw
        if worth_compressing(view, _lz4_len):
            frame = lz4.frame.compress(view)
            if len(frame) < view.nbytes:
                return frame, "lz4"
    return raw, None


def reply_tensors(p: Pending, views: dict) -> tuple[list[TensorMeta], list]:
    """The reply's TensorMetas and frames for `p`'s outputs (`views`: name -> (array, bytes view)
    of its rows in the output arena; the frames may be those views: the sender copies them)."""
    metas, payload = [], []
    for name in p.outputs:
        arr, raw = views[name]
        frame, compression = packed(p.compress, raw) if p.compress else (raw, None)
        shape = [p.rows, *arr.shape[1:]] if p.batched else list(arr.shape[1:])   # unbatched: its one row, no batch dim
        metas.append(TensorMeta(name=name, dtype=arr.dtype, shape=shape, compression=compression))
        payload.append(frame)
    return metas, payload
