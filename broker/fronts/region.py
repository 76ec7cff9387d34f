"""A front process's shared-memory region: its large input tensors cross to the broker in a
memfd the broker has mapped, not in fronts-socket frames (docs/FRONTS.md, "How a request travels").

The front registers one region (the native client's RegisterRegion, docs/PROTOCOL.md 5.9, sent
as ASK; the hub hands it to the door's regions with the message's Peer-Address, so the region
is this process's); then every input of at least THRESHOLD bytes - raw (no compression,
wire_dtype or CUDA handle), not a bytes tensor, its frame exactly the bytes its shape says - is
copied into a free slot and named by region/offset with an empty frame. No room: it travels as
a frame (`fallbacks`); never a wait, never a refusal.

When a slot is free again: the broker reads a slot until the request's batch is staged into
the ring, so after ANY reply for that request (outputs, an error, a generation's first output)
it no longer does. A withdrawn request gets no reply: its slots wait until a reply comes for a
request sent after the WITHDRAW (the hub reads the socket in order, so by then it has taken the
request out of its queue). The allocator is client/regions.py's first-fit one, without its lock
(one loop) and without output slices (outputs come back as frames).
"""
from __future__ import annotations

import fcntl
import mmap
import os

from tgw.shm.extents import Extents
from tgw.shm.wire import BYTES, DTYPE_SIZES, PROTOCOL_VERSION, RegisterRegion, nbytes_of

THRESHOLD = 16 * 1024          # inputs this large go into the region (bench/results/front-region-threshold.txt)
REGION_BYTES = 64 << 20        # one region per front life, at most server.max_region_bytes
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class FrontRegion:
    def __init__(self, nbytes: int, threshold: int = THRESHOLD):
        self.nbytes = (nbytes + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
        self.threshold = threshold
        self.fd = os.memfd_create(f"tgw-front-{os.getpid()}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.nbytes)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)   # the broker maps only what cannot shrink
            self._mm = mmap.mmap(self.fd, self.nbytes)
        except BaseException:
            os.close(self.fd)
            raise
        self.view = memoryview(self._mm)
        self.handle: int | None = None            # the broker's, once registered
        self.extents = Extents(self.nbytes)       # the free extents (shm/extents.py)
        self.held: dict[int, list[tuple[int, int]]] = {}   # front request id -> its slots
        self.limbo: list[tuple[int, list]] = []   # (last id sent at the WITHDRAW, slots), oldest first
        self.placed = self.fallbacks = 0

    def register_request(self) -> RegisterRegion:
        return RegisterRegion(v=PROTOCOL_VERSION, id=0, fd=self.fd, nbytes=self.nbytes, name=f"front {os.getpid()}")

    # ---- per request (remote_port.RemotePort) -------------------------------------------------

    def place(self, fid: int, inputs: list, bufs: list) -> list[int]:
        """Copy request `fid`'s large raw inputs into free slots: their metas name the region,
        their `bufs` become empty; which inputs were placed (the caller puts the metas back)."""
        if self.handle is None or len(bufs) != len(inputs):
            return []
        placed, taken = [], []
        for i, meta in enumerate(inputs):
            buf = bufs[i]
            n = buf.nbytes if type(buf) is memoryview else len(buf)
            if n < self.threshold or meta.region is not None or meta.compression is not None \
                    or meta.wire_dtype is not None or meta.cuda is not None or meta.dtype == BYTES \
                    or meta.dtype not in DTYPE_SIZES or n != nbytes_of(meta.dtype, meta.shape):
                continue   # a frame whose size is wrong stays one: admission names the mismatch
            at = self.extents.take(n)
            if at is None:
                self.fallbacks += 1
                continue
            mv = memoryview(buf)
            self.view[at:at + n] = mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")
            meta.region, meta.offset = self.handle, at
            bufs[i] = b""
            placed.append(i)
            taken.append((at, n))
        if taken:
            self.held[fid] = taken
            self.placed += len(taken)
        return placed

    @staticmethod
    def unmark(inputs: list, placed: list[int]) -> None:
        """The face's metas as they were (the message is the face's again)."""
        for i in placed:
            inputs[i].region, inputs[i].offset = None, 0

    def answered(self, fid: int) -> None:
        """A reply for request `fid` came: its slots are free, and so are those of requests
        withdrawn before it was sent."""
        if self.held:
            slots = self.held.pop(fid, None)
            if slots is not None:
                self._give_all(slots)
        limbo = self.limbo
        while limbo and limbo[0][0] < fid:
            self._give_all(limbo.pop(0)[1])

    def unsent(self, fid: int) -> None:
        """Request `fid` was never sent (its header failed to encode): its slots are free now."""
        slots = self.held.pop(fid, None)
        if slots is not None:
            self._give_all(slots)

    def withdrawn(self, fids: list[int], last_sent: int) -> None:
        """These requests were withdrawn when `last_sent` was the newest id sent."""
        slots = [s for fid in fids for s in self.held.pop(fid, ())] if self.held else []
        if slots:
            self.limbo.append((last_sent, slots))

    def as_dict(self) -> dict:
        return {"bytes": self.nbytes, "registered": self.handle is not None, "placed": self.placed,
                "fallbacks": self.fallbacks, "held": sum(len(s) for s in self.held.values()),
                "free_bytes": self.extents.free_bytes()}

    def close(self) -> None:
        self.view.release()
        self._mm.close()
        os.close(self.fd)

    def _give_all(self, slots: list) -> None:
        for at, n in slots:
            self.extents.give(at, n)
