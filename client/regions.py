"""Shared-memory regions (docs/PROTOCOL.md section 5.9): a client on the broker's host puts
large input tensors into a memfd the broker has mapped, and names them in the request instead
of sending their bytes; the broker may write the outputs back into it.

    region = client.region(64 << 20)                 # registers it (Client.region)
    y = client.infer("resnet", {"image": x}, region=region)
    region.close()                                   # unregisters it; also on client.close()

A Region is a memfd (MFD_ALLOW_SEALING), sealed against shrinking and growing (the broker maps
only memory that cannot be truncated under it, so it can never fault on it), mapped here and
by the broker. Inputs of at least `threshold` bytes are copied into free slots of it (a
thread-safe first-fit allocator: one Region may serve many threads and many calls in flight);
when it is full, a tensor travels as a frame as usual (`fallbacks` counts them); so do `bytes`
tensors, always (their layout is checked element by element on arrival: no region). With
`output_bytes` set (the bytes a call's outputs need, 64-byte aligned each), each call also
reserves an output slice; outputs the broker cannot fit there come back as frames.

Slots are released by Call.end, whichever way the call ends. An input slot is reused at once:
a broker still holding an abandoned request would compute on newer bytes, for a reply nobody
reads. An output slot of a call that ended without a reply (timeout, cancel, lost connection)
is not: the broker may still write into it. It is quarantined until `late_reply(req_id)` says
the late answer came, or `release(..., answered=True)`, or close (`quarantined` counts them).

After a broker restart every request naming the region is refused INVALID_ARGUMENT with details
reason "unknown_region": call `reregister()` (a new handle; the memory is the same) and retry.
The region belongs to the process that registered it: not usable after fork.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import threading
from typing import Callable

from tgw.shm.errors import Code, fail
from tgw.shm.extents import Extents
from tgw.shm.ring import align_up   # the broker's and the workers' 64-byte alignment
from tgw.shm.wire import BYTES, PROTOCOL_VERSION, RegionSlice, RegisterRegion, UnregisterRegion, nbytes_of

THRESHOLD = 64 * 1024        # inputs this large go into the region; smaller ones cost less as frames
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def output_bytes_for(sizes) -> int:
    """The output slice that holds outputs of these byte sizes, each 64-byte aligned."""
    return sum(align_up(n) for n in sizes)


class Slots:
    """What one call holds in a region: input slots, its output slice, whether its reply came."""
    __slots__ = ("inputs", "output", "req_id", "answered")

    def __init__(self, inputs: list, output: tuple | None, req_id: int):
        self.inputs, self.output, self.req_id, self.answered = inputs, output, req_id, False


class Region:
    def __init__(self, send: Callable | None, nbytes: int, *, threshold: int = THRESHOLD, name: str = "",
                 output_bytes: int = 0, register: bool = True):
        """A region of `nbytes` (rounded up to a page), registered at once through `send` unless
        `register` is False. `send(msg) -> reply` sends a `region` or `unregion` request (giving
        it its id and token) and returns the reply, raising the TgwError of an error reply
        (Client._control_call); an async client's `send` is a coroutine function: open_async."""
        if nbytes <= 0:
            raise fail(Code.INVALID_ARGUMENT, f"a region needs a positive size, got {nbytes}")
        self.nbytes = (nbytes + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
        self.send, self.threshold, self.output_bytes = send, threshold, output_bytes
        self.name = name or f"tgw-region-{os.getpid()}"
        self.fd = os.memfd_create(self.name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.nbytes)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)
            self._mm = mmap.mmap(self.fd, self.nbytes)
        except BaseException:
            os.close(self.fd)
            raise
        self._view = memoryview(self._mm)
        self._pid = os.getpid()
        self.handle: int | None = None      # the broker's, once registered
        self._lock = threading.Lock()
        self._extents = Extents(self.nbytes)   # the free extents (shm/extents.py), under the lock
        self._quarantine: dict[int, tuple] = {}   # request id -> output slice of a call with no reply yet
        self._outputs: dict[int, Slots] = {}      # output slice offset -> the call holding it
        self.fallbacks = 0                  # tensors sent as frames: no room
        self.quarantined = 0
        self.closed = False
        if register and send is not None:
            try:
                self.register()
            except BaseException:
                self.close(unregister=False)
                raise

    @classmethod
    async def open_async(cls, send, nbytes: int, **options) -> "Region":
        """A region registered through an async `send` (AsyncClient._control_call)."""
        region = cls(send, nbytes, register=False, **options)
        try:
            await region.aregister()
        except BaseException:
            region.close(unregister=False)
            raise
        return region

    # ---- registration ------------------------------------------------------------------------

    def register_request(self) -> RegisterRegion:
        return RegisterRegion(v=PROTOCOL_VERSION, id=0, fd=self.fd, nbytes=self.nbytes, name=self.name)

    def registered(self, reply) -> "Region":
        self.handle = reply.region
        return self

    def register(self) -> "Region":
        """Register with the broker through `send` (again, after a broker restart: reregister)."""
        if self.closed:
            raise RuntimeError("tgw Region is closed")
        return self.registered(self.send(self.register_request()))

    reregister = register

    async def aregister(self) -> "Region":
        """register, through an async `send` (also after a broker restart)."""
        if self.closed:
            raise RuntimeError("tgw Region is closed")
        return self.registered(await self.send(self.register_request()))

    areregister = aregister

    async def aclose(self) -> None:
        """close, unregistering through an async `send` (best effort)."""
        msg = None if self.closed else self.unregister_request()
        if msg is not None and self.send is not None and os.getpid() == self._pid:
            try:
                await self.send(msg)
            except Exception:  # noqa: BLE001 - swept by the broker when this process ends anyway
                pass
        self.close(unregister=False)

    def unregister_request(self) -> UnregisterRegion | None:
        return None if self.handle is None else UnregisterRegion(v=PROTOCOL_VERSION, id=0, region=self.handle)

    def close(self, unregister: bool = True) -> None:
        """Unregister (best effort, through `send`) and unmap. Calls still in flight fall back
        to, or fail with, nothing worse than unknown_region."""
        if self.closed:
            return
        self.closed = True
        msg = self.unregister_request()
        self.handle = None
        if unregister and msg is not None and self.send is not None and os.getpid() == self._pid:
            try:
                self.send(msg)
            except Exception:  # noqa: BLE001 - the broker sweeps it when this process ends anyway
                pass
        self._view.release()
        try:
            self._mm.close()
        except BufferError:   # a result still views it (never: outputs are copied out); unmapped with it
            pass
        os.close(self.fd)

    def __enter__(self) -> "Region":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the per-call seam (client/request.py) -----------------------------------------------

    def place(self, call) -> None:
        """Copy `call`'s large uncompressed inputs into free slots (their frames emptied) and
        reserve its output slice; what finds no room travels as frames."""
        handle = self.handle
        if handle is None or self.closed or os.getpid() != self._pid:
            return
        taken, frames, view = [], call.frames, self._view
        for i, meta in enumerate(call.msg.inputs):
            frame = frames[i]
            n = len(frame) if isinstance(frame, bytes) else memoryview(frame).nbytes
            if n < self.threshold or meta.compression is not None or meta.wire_dtype is not None \
                    or meta.cuda is not None or meta.dtype == BYTES:   # bytes tensors travel in frames
                continue
            at = self._alloc(n)
            if at is None:
                self.fallbacks += 1
                continue
            view[at:at + n] = frame
            meta.region, meta.offset = handle, at
            frames[i] = b""
            call.sent -= n
            taken.append((at, n))
        out = None
        if self.output_bytes > 0:
            at = self._alloc(self.output_bytes)
            if at is None:
                self.fallbacks += 1
            else:
                out = (at, self.output_bytes)
                call.msg.output_region = RegionSlice(region=handle, offset=at, nbytes=self.output_bytes)
        if taken or out is not None:
            call.slots = slots = Slots(taken, out, call.msg.id)
            if out is not None:
                self._outputs[out[0]] = slots

    def read_outputs(self, metas: list, frames: list, slots: Slots | None = None) -> list:
        """The reply's frames, with each output the broker wrote into the region copied out of it
        (its slice is reused once the call ends). A reply has come: the call's output slice (its
        `slots`, else the one the outputs name) is free again once the call ends."""
        if slots is not None:
            slots.answered = True
        out = None
        for i, meta in enumerate(metas):
            if meta.region is None:
                continue
            if meta.region != self.handle and self.handle is not None:
                raise fail(Code.INTERNAL, f"output {meta.name!r} was written into region {meta.region}, "
                           f"not this one ({self.handle})")
            if out is None:
                out = list(frames)
                held = self._outputs.get(meta.offset)   # the first output starts its slice
                if held is not None:
                    held.answered = True
            if meta.dtype == BYTES:
                raise fail(Code.INTERNAL, f"output {meta.name!r} is a bytes tensor written into region "
                           f"{meta.region}: bytes outputs travel in frames, never in a region")
            n = nbytes_of(meta.dtype, meta.shape)
            if meta.offset < 0 or meta.offset + n > self.nbytes:
                raise fail(Code.INTERNAL, f"output {meta.name!r} lies outside the region")
            out[i] = bytes(self._view[meta.offset:meta.offset + n])
        return frames if out is None else out

    def release(self, slots: Slots, answered: bool = False) -> None:
        """The call has ended (`answered`: with a reply, outputs or error): free its slots; the
        output slice of a call without a reply is quarantined (see the module's doc)."""
        with self._lock:
            for at, n in slots.inputs:
                self._give(at, n)
            if slots.output is not None:
                self._outputs.pop(slots.output[0], None)
                if answered or slots.answered:
                    self._give(*slots.output)
                else:
                    self._quarantine[slots.req_id] = slots.output
                    self.quarantined += 1

    def late_reply(self, req_id: int) -> None:
        """A reply came for a call that had already ended: its output slice is free again."""
        with self._lock:
            out = self._quarantine.pop(req_id, None)
            if out is not None:
                self._give(*out)

    # ---- allocator ---------------------------------------------------------------------------

    def _alloc(self, n: int) -> int | None:
        with self._lock:
            return self._extents.take(n)

    def _give(self, at: int, n: int) -> None:
        """Return [at, at + n) to the free list (lock held)."""
        self._extents.give(at, n)

    def free_bytes(self) -> int:
        with self._lock:
            return self._extents.free_bytes()
