"""The worker lane: one AF_UNIX stream socketpair per worker life, for the serving loop's messages.

ZeroMQ moves each message through an I/O thread on both sides (two thread hops a direction on
every batch); a socketpair is one write and one read, straight between the two processes. The
supervisor makes the pair at a spawn and passes the worker its end (WorkerStart.lane_fd); the
broker reads its end on its loop (broker/fleet/worker_link.py), the worker blocks on its own.

Liveness comes with the socket: when either process dies the kernel closes its end, the other
reads what was sent before and then EOF (LaneClosed) - at once, no heartbeat needed. A stream
socket keeps the order of everything sent on it, and bounds no message's size (a SEQPACKET
would cap a message at the socket buffer).

Frames: a 4-byte little-endian length, then the message (msgpack, shm/wire.py).
"""
from __future__ import annotations

import select
import socket
import struct

HEADER = struct.Struct("<I")
MAX_FRAME = (1 << 31) - 1
CHUNK = 1 << 16          # bytes read per recv; the buffer grows for a larger frame


class LaneClosed(ConnectionError):
    """The other end of the lane is closed: its process exited (or closed it)."""


def pair() -> tuple[socket.socket, socket.socket]:
    """A fresh lane: (the broker's end, the worker's end). Neither is inherited by a child
    unless passed (subprocess pass_fds)."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)


def frame(data: bytes) -> bytes:
    """`data` as sent on the lane: its length, then itself."""
    if len(data) > MAX_FRAME:
        raise ValueError(f"a lane message is at most {MAX_FRAME} bytes, got {len(data)}")
    return HEADER.pack(len(data)) + data


class Inbox:
    """What was read off a lane, cut into whole messages (a message may arrive in pieces)."""
    __slots__ = ("buf", "start", "end", "short")

    def __init__(self):
        self.buf = bytearray(CHUNK)
        self.start = self.end = 0
        self.short = False   # the last fill read less than it had room for: the socket was empty then

    def fill(self, sock: socket.socket) -> int:
        """One recv into the buffer: the bytes read (0 at EOF); BlockingIOError on a
        non-blocking socket with nothing to read, ConnectionError as the socket raises it."""
        if self.start == self.end:
            self.start = self.end = 0
        elif self.start and len(self.buf) - self.end < CHUNK:   # keep what is left, at the front
            n = self.end - self.start
            self.buf[:n] = self.buf[self.start:self.end]
            self.start, self.end = 0, n
        if len(self.buf) - self.end < CHUNK:
            self.buf.extend(bytes(max(CHUNK, len(self.buf))))
        with memoryview(self.buf) as view:
            n = sock.recv_into(view[self.end:])
        self.short = n < len(self.buf) - self.end
        self.end += n
        return n

    def take(self) -> bytes | None:
        """The next whole message, or None until more is read."""
        have = self.end - self.start
        if have < 4:
            return None
        size = HEADER.unpack_from(self.buf, self.start)[0]
        if have < 4 + size:
            if len(self.buf) - self.start < 4 + size:   # room for the rest, so fill() can finish it
                self.buf.extend(bytes(4 + size))
            return None
        first = self.start + 4
        self.start = first + size
        return bytes(self.buf[first:self.start])

    def whole(self) -> bool:
        """Whether a whole message is waiting in the buffer."""
        have = self.end - self.start
        return have >= 4 and have >= 4 + HEADER.unpack_from(self.buf, self.start)[0]


class Lane:
    """A lane's blocking end (the worker's): send, recv and poll as a ZeroMQ DEALER's are used."""

    def __init__(self, sock: socket.socket):
        sock.setblocking(True)
        self.sock, self.inbox = sock, Inbox()
        self._poll = select.poll()
        self._poll.register(sock.fileno(), select.POLLIN)
        self.closed = False

    @classmethod
    def from_fd(cls, fd: int) -> "Lane":
        return cls(socket.socket(fileno=fd))

    def send(self, data: bytes) -> None:
        """Send one message (blocking while the broker's side of the socket is full)."""
        try:
            self.sock.sendall(frame(data))
        except (BrokenPipeError, ConnectionResetError):
            raise LaneClosed("the broker closed the lane") from None

    def recv(self) -> bytes:
        """The next message (blocking); LaneClosed once the broker's end is closed."""
        inbox = self.inbox
        while True:
            msg = inbox.take()
            if msg is not None:
                return msg
            try:
                n = inbox.fill(self.sock)
            except ConnectionResetError:
                n = 0
            if not n:
                raise LaneClosed("the broker closed the lane")

    def poll(self, timeout_ms: int | None = None) -> bool:
        """Whether a message (or the end of the lane) is there to recv, waiting up to `timeout_ms`
        (None: until one is)."""
        if self.inbox.whole():
            return True
        return bool(self._poll.poll(timeout_ms))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()
