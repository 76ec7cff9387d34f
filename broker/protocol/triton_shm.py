"""Triton's client shared memory, the registry both faces share (docs/SHARED_MEMORY.md): who may
register a region, the regions, and how a request's tensors are read from and written to them.

A caller on this box registers a region by name - a POSIX shm segment (`/dev/shm/<key>`, as
tritonclient.utils.shared_memory creates it) or a CUDA allocation (a raw cudaIpcMemHandle, as
tritonclient.utils.cuda_shared_memory gives it) - and then names it in an inference request's
input and output parameters. Triton's regions are the server's, not a connection's: one registry
serves the HTTP and gRPC faces, and each face checks its own `allow_client_shm`; each face's
endpoints turn its transport into these calls (faces/http/shm_routes.py, faces/grpc/services.py).

Who: the uid the transport tells - for TCP over this host's network (loopback included), the
owner of the peer's socket in /proc/net/tcp{,6}, found by the connection's address pair - must
be the broker's effective uid; where no uid can be learned (a peer in another network
namespace), only a caller that presented the broker's token may register. Through a front process
(docs/FRONTS.md) the broker's face sees the front, so the front tells its own view of the peer in
FRONT_PEER, which a face trusts only on its Unix socket (front_peer_uid).

How: system regions are never mapped. The broker keeps the segment's fd and reads inputs with
os.preadv and writes outputs with os.pwrite: a caller that truncates its segment makes a short
read (the request is refused), never a SIGBUS in the broker, which an mmap of it would risk (the
native regions, front/regions.py, are memfds sealed against shrinking, so they may be mapped).
CUDA regions are passed to the GPU worker as CudaIpc descriptors (front/cuda_route.py,
workers/cuda_ipc.py): the broker touches no GPU memory and needs no CUDA.

The access checks, the registry and the infer path's part are one concept (they were three
modules cut for size before issue 38: shm_access, triton_shm, shm_routes).
"""
from __future__ import annotations

import ipaddress
import os
import socket
import stat
import sys
from typing import NamedTuple

from tgw.shm.bytes_tensor import BytesTensorError, element_count, starts
from tgw.shm.devices import norm_uuid
from tgw.shm.errors import Code, fail
from tgw.shm.wire import BYTES, DTYPE_SIZES, CudaIpc, TensorMeta, nbytes_of

from tgw.broker.front.cuda_route import REGISTERED, Declared
from tgw.broker.front.regions import SliceFrame

from .errors import refuse

MAX_REGIONS = 256            # both kinds together: each system region holds an open fd
NAME_MAX = 256
CUDA_IPC_HANDLE_BYTES = 64   # sizeof(cudaIpcMemHandle_t)
REGION, BYTE_SIZE, OFFSET = "shared_memory_region", "shared_memory_byte_size", "shared_memory_offset"
EXTENSIONS = ["system_shared_memory", "cuda_shared_memory"]   # the server metadata's, when a face allows them
SHM_DIR = "/dev/shm"
OWN_PREFIX = "tgw_"          # the broker's own segments (rings, arenas): never a caller's region
PROC_TCP = ("/proc/net/tcp", "/proc/net/tcp6")
FRONT_PEER = "tgw-front-peer"   # a front's view of its peer: "tcp HOST PORT LOCAL_HOST LOCAL_PORT", "uid N", "none"


# ---- who registers, and how a system region's bytes move ---------------------------------

class Caller(NamedTuple):
    """Who asks to register, as far as the transport tells: the uid the kernel gives for the
    connection's peer (None: the transport cannot tell), and whether it presented the token."""
    uid: int | None
    token: bool = False


def check_caller(caller: Caller) -> None:
    """The transport's word on who registers: its uid must be the broker's; unknown, a token."""
    if caller.uid is None:
        if not caller.token:
            raise refuse("the broker cannot tell which uid this caller runs as (it is not on this host's network: "
                         "no peer uid in /proc/net/tcp); shared memory registration from there needs "
                         "server.auth_token_file", "shm_caller_unknown", Code.UNAUTHENTICATED)
    elif caller.uid != os.geteuid():
        raise refuse(f"the caller runs as uid {caller.uid}; only the broker's own uid ({os.geteuid()}) may register "
                     "shared memory regions", "shm_uid", Code.UNAUTHENTICATED, uid=caller.uid, broker_uid=os.geteuid())


def segment_path(key: str) -> str:
    """/dev/shm/<key> as shm_open(3) names it: leading slashes dropped, no other slash."""
    if not isinstance(key, str):
        raise refuse(f"a shared memory key must be a string, got {key!r}", "shm_key")
    bare = key.lstrip("/")
    if not bare or "/" in bare or "\0" in bare or bare in (".", "..") or len(bare) > 255:
        raise refuse(f"shared memory key {key!r} is not a POSIX shm name (\"/name\": one component)", "shm_key",
                     key=key)
    if bare.startswith(OWN_PREFIX):
        raise refuse(f"shared memory key {key!r} names one of the broker's own segments ({OWN_PREFIX}*)", "shm_key",
                     key=key)
    return os.path.join(SHM_DIR, bare)


def open_segment(path: str, key: str) -> int:
    try:   # O_NOFOLLOW: a link in /dev/shm must not lead the broker to another file
        return os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise refuse(f"Unable to open shared memory region: {key!r}: {exc.strerror} ({path})", "shm_key",
                     key=key) from None


def read_segment(region, offset: int, size: int, what: str) -> bytearray:
    """Bytes [offset, offset + size) of a system region (SystemRegion), read from its
    fd (never mapped)."""
    buf = bytearray(size)
    got = 0
    while got < size:
        try:
            n = os.preadv(region.fd, [memoryview(buf)[got:]], region.offset + offset + got)
        except OSError as exc:
            raise refuse(f"{what}: cannot read shared memory region {region.name!r}: {exc.strerror}", "shm_io",
                         region=region.name) from None
        if n == 0:
            raise refuse(f"{what}: shared memory region {region.name!r} ends early: its segment {region.key!r} was "
                         "truncated after it was registered", "shm_truncated", region=region.name)
        got += n
    return buf


def write_segment(region, offset: int, data, size: int, what: str) -> None:
    """Write `data` at `offset` of the region through its fd; a segment truncated since it was
    registered is refused rather than grown back."""
    start = region.offset + offset
    if os.fstat(region.fd).st_size < start + size:
        raise refuse(f"{what}: shared memory region {region.name!r} ends early: its segment {region.key!r} was "
                     "truncated after it was registered", "shm_truncated", region=region.name)
    view, done = memoryview(data).cast("B"), 0
    while done < size:
        try:
            done += os.pwrite(region.fd, view[done:], start + done)
        except OSError as exc:
            raise refuse(f"{what}: cannot write shared memory region {region.name!r}: {exc.strerror}", "shm_io",
                         region=region.name) from None


def tcp_peer_uid(peer: tuple, local: tuple) -> int | None:
    """The uid owning the peer's end of a TCP connection on this host: the socket whose local
    address is `peer` and remote address is `local` ((host, port) each, as getpeername and
    getsockname give them); None when no such socket is in this network namespace."""
    try:
        wanted = {(_proc_address(peer[0], peer[1], v6), _proc_address(local[0], local[1], v6)) for v6 in (False, True)}
    except (ValueError, OSError, IndexError, TypeError):
        return None
    for path in PROC_TCP:
        try:
            with open(path) as f:
                next(f, None)   # the column names
                for line in f:
                    fields = line.split()
                    if len(fields) > 7 and (fields[1], fields[2]) in wanted:
                        return int(fields[7])
        except OSError:
            continue
    return None


def parse_front_peer(value: str | None) -> tuple | None:
    """FRONT_PEER's value: ("tcp", (host, port), (local_host, local_port)), ("uid", n), or None
    (absent, "none" or malformed)."""
    parts = (value or "").split()
    try:
        if len(parts) == 5 and parts[0] == "tcp":
            return "tcp", (parts[1], int(parts[2])), (parts[3], int(parts[4]))
        if len(parts) == 2 and parts[0] == "uid":
            return "uid", int(parts[1])
    except ValueError:
        pass
    return None


def front_peer_uid(value: str | None) -> int | None:
    """The uid of the peer a front described in FRONT_PEER (None: it cannot be told). Only a face's
    Unix socket, which only the broker's own processes reach, may be believed about it."""
    peer = parse_front_peer(value)
    if peer is None:
        return None
    return peer[1] if peer[0] == "uid" else tcp_peer_uid(peer[1], peer[2])


def _proc_address(host: str, port: int, v6: bool) -> str | None:
    """How /proc/net/tcp{,6} prints an address: each 32-bit word of it in host byte order, in hex,
    then the port. An IPv4 address in the v6 table is the v4-mapped one."""
    ip = ipaddress.ip_address(host.split("%")[0])
    if v6 and ip.version == 4:
        ip = ipaddress.IPv6Address(f"::ffff:{ip}")
    elif not v6 and ip.version == 6:
        if ip.ipv4_mapped is None:
            return None
        ip = ip.ipv4_mapped
    packed = socket.inet_pton(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, str(ip))
    words = "".join(f"{int.from_bytes(packed[i:i + 4], sys.byteorder):08X}" for i in range(0, len(packed), 4))
    return f"{words}:{int(port):04X}"


# ---- the registry ------------------------------------------------------------------------

class SystemRegion(NamedTuple):
    name: str
    key: str
    offset: int        # where the region starts in the segment
    byte_size: int
    fd: int


class CudaRegion(NamedTuple):
    name: str
    raw_handle: bytes
    device_id: int     # the GPU's index in the broker box's numbering ("cuda:N")
    byte_size: int


class Place(NamedTuple):
    """Where one output goes: its region, and where in it."""
    name: str          # the output's
    region: str
    offset: int
    byte_size: int
    cuda: CudaIpc | None = None   # a CUDA region's buffer: the worker writes it


class TritonShm:
    def __init__(self, max_bytes: int, roster: list | None = None):
        """`max_bytes`: server.max_region_bytes, the system regions' bytes in all; `roster`:
        the workers (a CUDA region needs one on its GPU)."""
        self.max_bytes, self.roster = max_bytes, roster if roster is not None else []
        self.system: dict[str, SystemRegion] = {}
        self.cuda: dict[str, CudaRegion] = {}
        self.counts = {"registrations": 0, "unregistrations": 0, "inputs": 0, "outputs": 0}

    # ---- system shared memory ----------------------------------------------------------------

    def register_system(self, name: str, key: str, offset: int, byte_size: int, caller: Caller | None = None) -> None:
        """Register bytes [offset, offset + byte_size) of segment `key` as region `name`.
        `caller`: what the transport tells of who asks (None: the broker itself, tests)."""
        self._check_new(name, caller)
        path = segment_path(key)
        _check_int(offset, "offset", name, minimum=0)
        _check_int(byte_size, "byte_size", name, minimum=1)
        used = sum(r.byte_size for r in self.system.values())
        if used + byte_size > self.max_bytes:
            raise refuse(f"system shared memory region {name!r}: {byte_size} bytes would bring the registered "
                         f"regions to {used + byte_size}; at most {self.max_bytes} (server.max_region_bytes)",
                         "shm_quota", Code.PAYLOAD_TOO_LARGE, region=name, limit=self.max_bytes)
        fd = open_segment(path, key)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise refuse(f"shared memory key {key!r} is not a shared memory segment", "shm_key", key=key)
            if st.st_uid != os.geteuid():
                raise refuse(f"shared memory key {key!r} belongs to uid {st.st_uid}; the broker maps only segments "
                             f"of its own uid ({os.geteuid()})", "shm_owner", Code.UNAUTHENTICATED, key=key,
                             owner=st.st_uid, broker_uid=os.geteuid())
            if offset + byte_size > st.st_size:
                raise refuse(f"failed to register shared memory region {name!r}: invalid args: bytes [{offset}, "
                             f"{offset + byte_size}) lie outside segment {key!r} of {st.st_size} bytes", "shm_bounds",
                             region=name, key=key, segment_bytes=st.st_size)
        except BaseException:
            os.close(fd)
            raise
        self.system[name] = SystemRegion(name, key, offset, byte_size, fd)
        self.counts["registrations"] += 1

    def unregister_system(self, name: str | None) -> None:
        """Drop region `name` (None or "": every system region). An unknown name is no error, as
        in Triton: unregistering is idempotent."""
        for region in _chosen(self.system, name):
            del self.system[region.name]
            os.close(region.fd)
            self.counts["unregistrations"] += 1

    def system_status(self, name: str | None) -> list[dict]:
        regions = [self._named(name, self.system, "system")] if name else list(self.system.values())
        return [{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size} for r in regions]

    # ---- CUDA shared memory ------------------------------------------------------------------

    def register_cuda(self, name: str, raw_handle: bytes, device_id: int, byte_size: int,
                      caller: Caller | None = None) -> None:
        """Register a CUDA allocation of `byte_size` bytes on GPU `device_id` by its raw
        cudaIpcMemHandle. The broker cannot open it (no CUDA here): a stale handle fails the
        first request that names it, in the worker (reason cuda_bad_handle)."""
        self._check_new(name, caller)
        if not isinstance(raw_handle, (bytes, bytearray)) or len(raw_handle) != CUDA_IPC_HANDLE_BYTES:
            size = len(raw_handle) if isinstance(raw_handle, (bytes, bytearray)) else type(raw_handle).__name__
            raise refuse(f"CUDA shared memory region {name!r}: raw_handle must be the {CUDA_IPC_HANDLE_BYTES} bytes "
                         f"of a cudaIpcMemHandle_t, got {size}", "shm_cuda_handle", region=name)
        _check_int(device_id, "device_id", name, minimum=0)
        _check_int(byte_size, "byte_size", name, minimum=1)
        if self._worker_on(device_id) is None:
            raise refuse(f"CUDA shared memory region {name!r} lives on cuda:{device_id}, where this broker runs no "
                         f"worker (workers: {sorted({w.device for w in self.roster})})", "no_worker_on_device",
                         region=name, device=f"cuda:{device_id}")
        self.cuda[name] = CudaRegion(name, bytes(raw_handle), device_id, byte_size)
        self.counts["registrations"] += 1

    def unregister_cuda(self, name: str | None) -> None:
        for region in _chosen(self.cuda, name):
            del self.cuda[region.name]
            self.counts["unregistrations"] += 1

    def cuda_status(self, name: str | None) -> list[dict]:
        regions = [self._named(name, self.cuda, "cuda")] if name else list(self.cuda.values())
        return [{"name": r.name, "device_id": r.device_id, "byte_size": r.byte_size} for r in regions]

    # ---- inference ---------------------------------------------------------------------------

    def input_frame(self, meta: TensorMeta, params: dict):
        """The frame for input `meta` when its parameters name a region (None: they do not):
        its bytes read from a system region, or for a CUDA region meta.cuda set and a Declared."""
        if REGION not in params:
            return None
        what = f"input {meta.name!r}"
        region, offset, size = self._slice(params, what)
        if meta.dtype == BYTES:
            return self._bytes_input(meta, region, offset, size, what)
        if meta.dtype not in DTYPE_SIZES:
            raise refuse(f"{what}: unknown datatype {meta.dtype!r}", "shm_dtype", input=meta.name)
        need = nbytes_of(meta.dtype, meta.shape)
        if size != need:
            raise refuse(f"input byte size mismatch for input {meta.name!r}. Expected {need}, got {size} "
                         f"(shared_memory_byte_size; shape {meta.shape} of {meta.dtype})", "shm_byte_size",
                         input=meta.name, byte_size=size, expected=need)
        if isinstance(region, CudaRegion):
            if offset % DTYPE_SIZES[meta.dtype]:
                raise refuse(f"{what}: shared_memory_offset {offset} is not a multiple of {DTYPE_SIZES[meta.dtype]} "
                             f"({meta.dtype})", "shm_alignment", input=meta.name)
            meta.cuda = self._descriptor(region, offset, size)
            frame = Declared(size)
        else:
            frame = SliceFrame(memoryview(read_segment(region, offset, size, what)))
        self.counts["inputs"] += 1
        return frame

    def _bytes_input(self, meta: TensorMeta, region, offset: int, size: int, what: str) -> SliceFrame:
        """A BYTES input in Triton's layout (each element a 4-byte little-endian length, then its
        bytes: tgw's own frame layout), checked to be exactly the shape's elements in `size` bytes."""
        if isinstance(region, CudaRegion):   # the broker reads no GPU memory, and a BYTES frame must be read
            raise refuse(f"{what} names CUDA shared memory region {region.name!r}: a BYTES tensor is read by the "
                         "broker, which maps no GPU memory; put it in a system shared memory region",
                         "shm_bytes_cuda", input=meta.name, region=region.name)
        data = read_segment(region, offset, size, what)
        try:
            starts(data, element_count(meta.shape))
        except BytesTensorError as exc:
            raise refuse(f"{what}: the {size} bytes at offset {offset} of shared memory region {region.name!r} are "
                         f"not {element_count(meta.shape)} BYTES elements of shape {meta.shape} (each a 4-byte "
                         f"little-endian length, then its bytes): {exc}", "shm_bytes_layout", input=meta.name,
                         region=region.name) from None
        self.counts["inputs"] += 1
        return SliceFrame(memoryview(data))

    def output_place(self, name: str, params: dict) -> Place | None:
        """Where output `name` goes when its parameters name a region (None: they do not)."""
        if REGION not in params:
            return None
        region, offset, size = self._slice(params, f"output {name!r}")
        cuda = self._descriptor(region, offset, size) if isinstance(region, CudaRegion) else None
        return Place(name, region.name, offset, size, cuda)

    def write_output(self, place: Place, meta: TensorMeta, data) -> dict:
        """Write output `meta` (its bytes `data`) to its place; the reply's parameters for it.
        A CUDA place was written by the worker (meta.cuda set): nothing to copy."""
        what = f"output {meta.name!r}"
        if meta.dtype == BYTES and place.cuda is not None:
            raise refuse(f"{what} is a BYTES tensor: the broker writes it in Triton's layout, and maps no GPU "
                         f"memory; name a system shared memory region for it, not CUDA region {place.region!r}",
                         "shm_bytes_cuda", output=meta.name, region=place.region)
        if place.cuda is not None:
            if meta.cuda is None:
                raise fail(Code.INTERNAL, f"{what}: the worker did not write CUDA region {place.region!r}",
                           output=meta.name)
            size = nbytes_of(meta.dtype, meta.shape)
        else:
            size = len(memoryview(data).cast("B"))
            if size > place.byte_size:
                raise refuse(f"{what} holds {size} bytes; shared_memory_byte_size {place.byte_size} of region "
                             f"{place.region!r} is too small to hold it", "shm_output_too_small", output=meta.name,
                             byte_size=place.byte_size, needed=size)
            region = self.system.get(place.region)
            if region is None:
                raise refuse(f"{what}: system shared memory region {place.region!r} was unregistered before the "
                             "reply", "shm_unknown_region", region=place.region)
            write_segment(region, place.offset, data, size, what)
        self.counts["outputs"] += 1
        params = {REGION: place.region, BYTE_SIZE: size}
        if place.offset:
            params[OFFSET] = place.offset
        return params

    def close(self) -> None:
        """Drop every region (the broker stops)."""
        self.unregister_system(None)
        self.unregister_cuda(None)

    def as_dict(self) -> dict[str, int]:
        return {"system": len(self.system), "system_bytes": sum(r.byte_size for r in self.system.values()),
                "cuda": len(self.cuda), **self.counts}

    # ---- checks ------------------------------------------------------------------------------

    def _check_new(self, name: str, caller: Caller | None) -> None:
        if not isinstance(name, str) or not name or len(name) > NAME_MAX:
            raise refuse(f"a shared memory region needs a name of 1 to {NAME_MAX} characters, got {name!r}",
                         "shm_name")
        if caller is not None:
            check_caller(caller)
        if name in self.system or name in self.cuda:
            kind = "system" if name in self.system else "CUDA"
            raise refuse(f"shared memory region {name!r} already in manager (registered as {kind} shared memory; "
                         "unregister it first)", "shm_exists", region=name)
        if len(self.system) + len(self.cuda) >= MAX_REGIONS:
            raise refuse(f"{MAX_REGIONS} shared memory regions are registered, the most this broker holds",
                         "shm_quota", Code.PAYLOAD_TOO_LARGE, limit=MAX_REGIONS)

    def _named(self, name: str, table: dict, kind: str):
        region = table.get(name)
        if region is None:
            raise refuse(f"Unable to find {kind} shared memory region: {name!r}", "shm_unknown_region", region=name)
        return region

    def _slice(self, params: dict, what: str) -> tuple[SystemRegion | CudaRegion, int, int]:
        """The region a tensor's parameters name, and its offset and byte size in it, checked."""
        name = params.get(REGION)
        if not isinstance(name, str):
            raise refuse(f"{what}: {REGION} must be a region's name, got {name!r}", "shm_name")
        region = self.system.get(name) or self.cuda.get(name)
        if region is None:
            raise refuse(f"Unable to find shared memory region: {name!r} ({what} names it; it is not registered)",
                         "shm_unknown_region", region=name)
        if BYTE_SIZE not in params:
            raise refuse(f"{what} names shared memory region {name!r} without {BYTE_SIZE}", "shm_byte_size",
                         region=name)
        size, offset = params[BYTE_SIZE], params.get(OFFSET, 0)
        for key, value in ((BYTE_SIZE, size), (OFFSET, offset)):
            if type(value) is not int or value < 0:
                raise refuse(f"{what}: {key} must be a non-negative integer, got {value!r}", "shm_byte_size",
                             region=name)
        if offset >= region.byte_size or offset + size > region.byte_size:
            which = "offset" if offset >= region.byte_size else "offset + byte size"
            raise refuse(f"Invalid {which} for shared memory region: {name!r} ({what}: bytes [{offset}, "
                         f"{offset + size}) lie outside its {region.byte_size} bytes)", "shm_bounds", region=name,
                         offset=offset, byte_size=size, region_bytes=region.byte_size)
        return region, offset, size

    def _worker_on(self, device_id: int):
        return next((w for w in self.roster if w.device == f"cuda:{device_id}"), None)

    def _descriptor(self, region: CudaRegion, offset: int, size: int) -> CudaIpc:
        """The CudaIpc a worker opens for [offset, offset + size) of a CUDA region: the storage
        starts `offset` into the allocation; no torch ref counter, no event (the caller has its data
        in place before it asks, as with Triton)."""
        worker = self._worker_on(region.device_id)
        if worker is None:
            raise refuse(f"CUDA shared memory region {region.name!r} lives on cuda:{region.device_id}, where no "
                         "worker runs now", "no_worker_on_device", region=region.name,
                         device=f"cuda:{region.device_id}")
        return CudaIpc(device=region.device_id, device_uuid=norm_uuid(getattr(worker, "device_uuid", "")),
                       handle=region.raw_handle, storage_bytes=size, storage_offset_bytes=offset)


# ---- the infer path's part ---------------------------------------------------------------

def route(decoded) -> tuple:
    """Ready a decoded request naming regions for the front door: outputs into CUDA regions
    become output_cuda; the door's extra arguments (the REGISTERED header when a CUDA region is
    named: the registry vouches for its handles, whichever transport the request came over).
    `decoded`: either face's decoded request (its `infer` and its outputs' `places`)."""
    msg = decoded.infer
    for name, place in decoded.places.items():
        if place.cuda is not None:
            msg.output_cuda[name] = place.cuda
    if msg.output_cuda or any(t.cuda is not None for t in msg.inputs):
        return (REGISTERED,)
    return ()


def written(shm: TritonShm | None, decoded, reply, frames: list) -> dict[str, dict]:
    """The outputs written into their regions: {name: the reply's parameters for it}."""
    if not decoded.places:
        return {}
    placed = {}
    for meta, frame in zip(reply.outputs, frames):
        place = decoded.places.get(meta.name)
        if place is not None:
            placed[meta.name] = shm.write_output(place, meta, frame)
    return placed


def _chosen(table: dict, name: str | None) -> list:
    """The regions an unregister names: one (none when unknown), or all for None or ""."""
    if not name:
        return list(table.values())
    return [table[name]] if name in table else []


def _check_int(value, key: str, name: str, minimum: int) -> None:
    if type(value) is not int or value < minimum:
        raise refuse(f"failed to register shared memory region {name!r}: invalid args: {key} must be an integer of "
                     f"at least {minimum}, got {value!r}", "shm_" + key, region=name)
