"""Triton's client shared memory, the access part: who may register a region, and how a system
region's bytes are read and written without ever mapping them (docs/SHARED_MEMORY.md).

Who: the uid the transport tells - for TCP over this host's network (loopback included), the
owner of the peer's socket in /proc/net/tcp{,6}, found by the connection's address pair - must
be the broker's effective uid; where no uid can be learned (a peer in another network
namespace), only a caller that presented the broker's token may register.

How: through the segment's fd with os.preadv / os.pwrite, so a segment truncated under the
broker makes a short read, answered as an error, never a SIGBUS.
"""
from __future__ import annotations

import ipaddress
import os
import socket
import sys
from typing import NamedTuple

from tgw.shm.errors import Code, TgwError, fail

SHM_DIR = "/dev/shm"
OWN_PREFIX = "tgw_"          # the broker's own segments (rings, arenas): never a caller's region
PROC_TCP = ("/proc/net/tcp", "/proc/net/tcp6")


def refuse(message: str, reason: str, code: Code = Code.INVALID_ARGUMENT, **details) -> TgwError:
    return fail(code, message, reason=reason, **details)


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
        raise refuse(f"cannot open shared memory key {key!r} ({path}): {exc.strerror}", "shm_key", key=key) from None


def read_segment(region, offset: int, size: int, what: str) -> bytearray:
    """Bytes [offset, offset + size) of a system region (triton_shm.SystemRegion), read from its
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
