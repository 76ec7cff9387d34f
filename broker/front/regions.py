"""Client shared-memory regions (docs/PROTOCOL.md section 5.9): a caller on this host registers
a memfd, writes large tensors into it and names them in its requests (TensorMeta.region, an
empty frame), so their bytes never cross the socket; outputs may be written back into it
(Infer.output_region).

Who may register: only a caller on an ipc:// connection (the kernel's SO_PEERCRED, which
ZeroMQ hands over as the header frame's Peer-Address ":uid:gid:pid"; nothing the message says
about itself is believed) whose uid equals the broker's effective uid - a root broker too
requires uid 0, so a root broker never maps another user's memory. The fd must be a memfd
sealed against shrinking (F_SEAL_SHRINK), so the mapping can never lose its pages under the
broker (no SIGBUS), at least `nbytes` long. A region belongs to the caller's process (pid and
its start time, against pid reuse), not to a socket: the sync client opens one socket per
thread. Regions of processes that are gone are swept (tick, at most once a second).

The broker copies region bytes into the ring like any frame's (pool.stage): a batch is one
contiguous block of rows from several requests, so a worker needs the rows copied together
anyway; a 602 KB copy costs ~13 µs (bench/regions_bench.py). A region dropped while requests
hold slices of it stays mapped until the last slice goes (mmap will not close under views).
"""
from __future__ import annotations

import fcntl
import itertools
import mmap
import os
import time
from typing import Callable


from tgw.shm.errors import Code, TgwError, fail
from tgw.shm.ring import align_up
from tgw.shm.wire import BYTES, DTYPE_SIZES, PROTOCOL_VERSION, Infer, RegionReply, RegisterRegion, TensorMeta, \
    UnregisterRegion, nbytes_of

from .peers import peer_credentials, process_start
from tgw.broker.state.pending import Pending

SWEEP_S = 1.0               # how often regions of dead processes are looked for
MAX_REGIONS_PER_PROCESS = 64
SEALS_NEEDED = fcntl.F_SEAL_SHRINK


class SliceFrame:
    """Bytes that are no ZeroMQ frame, as admission reads a tensor frame: `.buffer`, and len() in
    bytes. Region slices here; the HTTP face's tensors too (protocol/kserve.py), so one shape serves both."""
    __slots__ = ("buffer",)

    def __init__(self, buffer: memoryview):
        self.buffer = buffer

    def __len__(self) -> int:
        return self.buffer.nbytes


class RegionFrame(SliceFrame):
    """A slice of a caller's region: its bytes are the caller's again once the request is
    answered (a client reuses the slot, a front process too), so whatever reads them after the
    answer - a shadow's copy of the request - takes `kept()` at answer time."""
    __slots__ = ()

    def kept(self) -> SliceFrame:
        return SliceFrame(memoryview(bytes(self.buffer)))


class Region:
    __slots__ = ("handle", "pid", "started", "uid", "nbytes", "name", "mm", "view")

    def __init__(self, handle: int, pid: int, started: float, uid: int, nbytes: int, name: str, mm: mmap.mmap):
        self.handle, self.pid, self.started, self.uid = handle, pid, started, uid
        self.nbytes, self.name, self.mm, self.view = nbytes, name, mm, memoryview(mm)

    def close(self) -> None:
        self.view.release()     # slices already taken stay valid: they hold the mapping
        try:
            self.mm.close()
        except BufferError:     # requests still hold slices: unmapped when the last one goes
            pass


def peer_of(header) -> tuple[int, int] | None:
    """(uid, pid) of the process at the other end of an ipc:// connection; None for tcp:// (or an
    HTTP caller: no header frame)."""
    peer = peer_credentials(header) if header is not None else None
    return None if peer is None else (peer.uid, peer.pid)


def refuse(code: Code, reason: str, message: str, **details) -> TgwError:
    return fail(code, message, reason=reason, **details)


class Regions:
    """The registered regions, by handle (never reused within a broker's life)."""

    def __init__(self, max_bytes: int, reply: Callable, error: Callable, note: Callable,
                 clock: Callable[[], float] = time.monotonic):
        self.max_bytes = max_bytes           # server.max_region_bytes: one process's regions, in all
        self.reply, self.error, self.note, self.clock = reply, error, note, clock
        self.table: dict[int, Region] = {}
        self.handles, self.swept_at = itertools.count(1), 0.0
        self.counts = {"registrations": 0, "unregistrations": 0, "refused": 0, "swept": 0, "inputs": 0,
                       "outputs": 0, "output_fallbacks": 0}

    def handle(self, ident, msg, header) -> None:
        try:
            answer = (self.register if isinstance(msg, RegisterRegion) else self.unregister)(msg, peer_of(header))
        except TgwError as err:
            self.counts["refused"] += 1
            self.note("refused", err.details.get("reason", err.code.value), err.message)
            return self.error(ident, msg.id, err)
        self.reply(ident, answer)

    def register(self, msg: RegisterRegion, peer: tuple[int, int] | None) -> RegionReply:
        uid, pid = self._check_peer(peer)
        nbytes = msg.nbytes
        if not 0 < nbytes <= self.max_bytes:
            raise refuse(Code.INVALID_ARGUMENT, "region_size", f"region of {nbytes} bytes: it must hold 1 to "
                         f"{self.max_bytes} bytes (server.max_region_bytes)", limit=self.max_bytes)
        mine = [r for r in self.table.values() if r.pid == pid]
        if len(mine) >= MAX_REGIONS_PER_PROCESS or sum(r.nbytes for r in mine) + nbytes > self.max_bytes:
            raise refuse(Code.PAYLOAD_TOO_LARGE, "region_quota", f"process {pid} has {len(mine)} regions of "
                         f"{sum(r.nbytes for r in mine)} bytes; one process may register at most "
                         f"{MAX_REGIONS_PER_PROCESS} regions and {self.max_bytes} bytes (server.max_region_bytes)",
                         limit=self.max_bytes)
        started = process_start(pid)
        if started is None:
            raise refuse(Code.INVALID_ARGUMENT, "region_fd", f"process {pid} is gone")
        mm = map_memfd(pid, msg.fd, nbytes)
        region = Region(next(self.handles), pid, started, uid, nbytes, msg.name[:64], mm)
        self.table[region.handle] = region
        self.counts["registrations"] += 1
        return RegionReply(v=PROTOCOL_VERSION, id=msg.id, region=region.handle, nbytes=nbytes)

    def unregister(self, msg: UnregisterRegion, peer: tuple[int, int] | None) -> RegionReply:
        region = self._owned(msg.region, peer)
        self.drop(region)
        self.counts["unregistrations"] += 1
        self.sweep(self.clock())
        return RegionReply(v=PROTOCOL_VERSION, id=msg.id, region=region.handle, nbytes=region.nbytes,
                           registered=False)

    def drop(self, region: Region) -> None:
        self.table.pop(region.handle, None)
        region.close()

    @staticmethod
    def named(msg: Infer) -> bool:
        """Does the request name a region at all (the cheap test every request pays)?"""
        if msg.output_region is not None:
            return True
        for t in msg.inputs:
            if t.region is not None:
                return True
        return False

    def resolve(self, msg: Infer, header, frames: list) -> list:
        """The tensor frames with each region tensor's (empty) frame replaced by its slice of
        the region; checks the output slice too. Raises the TgwError that answers the request."""
        peer = peer_of(header) if header is not None else None
        out = list(frames)
        for i, t in enumerate(msg.inputs):
            if t.region is None:
                continue
            region = self._owned(t.region, peer)
            if t.compression is not None or t.wire_dtype is not None or t.cuda is not None:
                raise refuse(Code.INVALID_ARGUMENT, "region_encoding", f"input {t.name!r} names region {t.region}: "
                             "its bytes are raw, so it may not also set compression, wire_dtype or cuda", input=t.name)
            if t.dtype == BYTES:
                raise refuse(Code.INVALID_ARGUMENT, "region_bytes", f"input {t.name!r} names region {t.region}: it is "
                             "a bytes tensor, whose layout travels in its frame, never in a region", input=t.name)
            if i >= len(out) or len(out[i]):
                raise refuse(Code.INVALID_ARGUMENT, "region_frame", f"input {t.name!r} names region {t.region}: its "
                             "frame must be empty", input=t.name)
            if t.dtype not in DTYPE_SIZES:
                continue        # admission names the bad dtype
            n = nbytes_of(t.dtype, t.shape)
            self._in_bounds(region, t.offset, n, f"input {t.name!r}")
            out[i] = RegionFrame(region.view[t.offset:t.offset + n])
            self.counts["inputs"] += 1
        s = msg.output_region
        if s is not None:
            self._in_bounds(self._owned(s.region, peer), s.offset, s.nbytes, "output_region")
        return out

    def write(self, p: Pending, views: dict) -> tuple[list[TensorMeta], list] | None:
        """p's outputs written one after another (64-byte aligned) into its output region slice:
        the reply's metas and (empty) frames; None when they do not fit, or the region is gone
        (the reply then carries frames: nothing is lost)."""
        s = p.output_region
        region = self.table.get(s.region)
        if any(views[name][0].dtype == BYTES for name in p.outputs):   # refused at admission: never here
            region = None
        end, pos, places = s.offset + s.nbytes, s.offset, []
        if region is not None:
            for name in p.outputs:
                pos = align_up(pos)
                places.append(pos)
                pos += views[name][1].nbytes
        if region is None or pos > end or end > region.nbytes:
            self.counts["output_fallbacks"] += 1
            return None
        metas, view = [], region.view
        for name, at in zip(p.outputs, places):
            t, data = views[name]
            view[at:at + data.nbytes] = data
            shape = [p.rows, *t.shape[1:]] if p.batched else list(t.shape[1:])   # unbatched: no batch dim
            metas.append(TensorMeta(name=name, dtype=t.dtype, shape=shape, region=s.region,
                                    offset=at))
        self.counts["outputs"] += 1
        return metas, [b""] * len(metas)

    def _check_peer(self, peer: tuple[int, int] | None) -> tuple[int, int]:
        if peer is None:
            raise refuse(Code.UNAUTHENTICATED, "region_needs_ipc", "shared-memory regions need an ipc:// "
                         "connection (the broker learns the caller's uid and pid from the kernel)")
        if peer[0] != os.geteuid():
            raise refuse(Code.UNAUTHENTICATED, "region_uid", f"the caller runs as uid {peer[0]}; only the "
                         f"broker's own uid ({os.geteuid()}) may register shared-memory regions",
                         uid=peer[0], broker_uid=os.geteuid())
        return peer

    def _owned(self, handle: int, peer: tuple[int, int] | None) -> Region:
        uid, pid = self._check_peer(peer)
        region = self.table.get(handle)
        if region is None:
            raise refuse(Code.INVALID_ARGUMENT, "unknown_region", f"region {handle} is not registered (after a "
                         "broker restart, register the region again)", region=handle)
        if region.pid != pid:
            raise refuse(Code.INVALID_ARGUMENT, "region_owner", f"region {handle} belongs to another process",
                         region=handle)
        return region

    @staticmethod
    def _in_bounds(region: Region, offset: int, n: int, what: str) -> None:
        if offset < 0 or n < 0 or offset + n > region.nbytes:
            raise refuse(Code.INVALID_ARGUMENT, "region_bounds", f"{what}: bytes [{offset}, {offset + n}) are "
                         f"outside region {region.handle} of {region.nbytes} bytes", region=region.handle,
                         offset=offset, nbytes=n, region_bytes=region.nbytes)

    def tick(self, now: float) -> None:   # the broker's periodic look
        if self.table and now - self.swept_at >= SWEEP_S:
            self.sweep(now)

    def sweep(self, now: float) -> None:
        """Drop the regions of processes that are gone (or whose pid now names another process)."""
        self.swept_at = now
        alive: dict[int, float | None] = {}
        for region in list(self.table.values()):
            if region.pid not in alive:
                alive[region.pid] = process_start(region.pid)
            if alive[region.pid] != region.started:
                self.drop(region)
                self.counts["swept"] += 1

    def as_dict(self) -> dict[str, int]:
        return {"registered": len(self.table), "bytes": sum(r.nbytes for r in self.table.values()), **self.counts}



def map_memfd(pid: int, fd: int, nbytes: int) -> mmap.mmap:
    """Map the caller's fd `fd` through /proc; refused unless it is a memfd sealed against
    shrinking, of at least `nbytes`."""
    path = f"/proc/{pid}/fd/{fd}"
    try:
        target = os.readlink(path) if fd >= 0 else ""
    except OSError as exc:
        raise refuse(Code.INVALID_ARGUMENT, "region_fd", f"cannot see fd {fd} of process {pid}: {exc.strerror}",
                     fd=fd) from None
    if not target.startswith("/memfd:"):
        raise refuse(Code.INVALID_ARGUMENT, "region_not_memfd", f"fd {fd} is {target or 'nothing'}; a region must "
                     "be a memfd (os.memfd_create with MFD_ALLOW_SEALING)", fd=fd)
    try:
        own = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise refuse(Code.INVALID_ARGUMENT, "region_fd", f"cannot open fd {fd} of process {pid}: {exc.strerror}",
                     fd=fd) from None
    try:
        if _seals(own) & SEALS_NEEDED != SEALS_NEEDED:
            raise refuse(Code.INVALID_ARGUMENT, "region_unsealed", f"fd {fd} is not sealed against shrinking "
                         "(fcntl F_ADD_SEALS F_SEAL_SHRINK | F_SEAL_GROW): the broker maps only memory that cannot "
                         "be truncated under it", fd=fd)
        size = os.fstat(own).st_size
        if size < nbytes:
            raise refuse(Code.INVALID_ARGUMENT, "region_size", f"fd {fd} holds {size} bytes, not the {nbytes} "
                         "registered", fd=fd, size=size)
        try:
            return mmap.mmap(own, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:   # e.g. sealed against writes
            raise refuse(Code.INVALID_ARGUMENT, "region_fd", f"cannot map fd {fd} read-write: {exc.strerror}",
                         fd=fd) from None
    finally:
        os.close(own)


def _seals(fd: int) -> int:
    try:
        return fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:   # not a memfd (nor shmem): no seals at all
        return 0
