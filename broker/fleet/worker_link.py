"""The broker's link to its workers: the ZeroMQ back socket, and each worker life's lane.

A worker's beacon (heartbeats, snapshots) and loader (run-time loads) threads each have a DEALER
on the back socket (a ROUTER) and always talk there. The serving loop's messages -
the hello and its answer, Batch, Done, Release, Withdraw, Steps, Stop - are on the per-batch
path, and with `workers.doorbell: socket` (the default) they take the worker life's lane
instead (shm/doorbell.py: a socketpair, no ZeroMQ I/O thread on either side); with `zmq` they
stay on the back socket, as before the lanes.

A lane is opened at each spawn (`open_lane`, the supervisor's hook) and dies with its worker:
what it sent before is read first, then EOF closes the lane and asks the lifecycle to look at
the worker's exit now (`on_gone`; its pidfd usually says the same a moment later). Both paths
hand each message to the same handler, as [identity, body] frames, and call `after` (the
serving flush) once a read pass ends (for the lanes, one epoll set of them all: see WorkerLink).
"""
from __future__ import annotations

import asyncio
import logging
import select
import socket
from typing import Callable

import zmq

from tgw.shm import doorbell
from tgw.shm.wire import encode

from tgw.broker.front.sockets import Pump

log = logging.getLogger("tgw.broker")
READS = 64   # recv calls a pass makes on one lane before yielding to the loop's other work


class _Frame:
    """What the handler reads of a ZeroMQ frame: `.bytes` (the identity) and `.buffer` (the body)."""
    __slots__ = ("bytes", "buffer")

    def __init__(self, data: bytes | None):
        self.bytes = self.buffer = data


class _Lane:
    """The broker's end of one worker life's lane, read and written on the loop, never blocking."""

    def __init__(self, link: "WorkerLink", identity: bytes, sock: socket.socket):
        sock.setblocking(False)
        self.link, self.identity, self.sock, self.fd = link, identity, sock, sock.fileno()
        self.inbox = doorbell.Inbox()
        self.out = bytearray()     # what the socket did not take yet (a busy worker), sent in order
        self.closed = False

    def read(self) -> bool:
        """Hand every whole message waiting to the handler; False at EOF (the worker is gone)."""
        frames = [_Frame(self.identity), _Frame(None)]
        handler, inbox, sock = self.link.handler, self.inbox, self.sock
        for _ in range(READS):
            try:
                n = inbox.fill(sock)
            except BlockingIOError:
                return True
            except ConnectionError:
                n = 0
            while (msg := inbox.take()) is not None:
                frames[1].buffer = msg
                try:
                    handler(frames)
                except Exception:  # one bad message must not stall the rest
                    log.exception("handler failed on a message; continuing")
            if not n:
                return False
            if inbox.short:   # read all there was: no second recv (and its exception) to learn it
                return True
        return True   # more may be waiting: the poll says so again on the next wake

    def send(self, data: bytes) -> None:
        if self.closed:
            return   # its worker is gone: what it was owed is the death's to settle
        data = doorbell.frame(data)
        if self.out:
            self.out += data
            return
        try:
            n = self.sock.send(data)
        except BlockingIOError:
            n = 0
        except (BrokenPipeError, ConnectionResetError):
            return   # dead: EOF (or its pidfd) tells the lifecycle
        if n < len(data):
            self.out = bytearray(data[n:])
            self.link.loop.add_writer(self.fd, self._flush)

    def _flush(self) -> None:
        try:
            n = self.sock.send(self.out)
        except BlockingIOError:
            return
        except (BrokenPipeError, ConnectionResetError):
            n = len(self.out)
        del self.out[:n]
        if not self.out:
            self.link.loop.remove_writer(self.fd)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.out:
            self.link.loop.remove_writer(self.fd)
            self.out = bytearray()
        self.sock.close()


class WorkerLink:
    """Built with the sockets, so placement and the memory watch can be given `send`; it listens
    once the core that handles what workers send exists.

    The lanes sit in one epoll set of their own, on the loop as one reader: a wake reads every
    lane with something to say, then calls `after` once, as one drain of the back socket does -
    two workers' completions of the same moment are both in before the next batches are formed."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: zmq.Socket, doorbell_kind: str = "zmq"):
        """`doorbell_kind`: workers.doorbell ("socket": lanes for the serving loops; "zmq": none)."""
        self.loop, self.sock = loop, sock
        self.pump: Pump | None = None
        self.handler: Callable[[list], None] | None = None
        self.after: Callable[[], None] | None = None
        self.lanes: dict[bytes, _Lane] = {}   # worker life's identity -> its lane, until EOF
        self._by_fd: dict[int, _Lane] = {}
        self._ready = select.epoll() if doorbell_kind == "socket" else None   # the lanes' fds, level-triggered
        # a lane's EOF: its worker exited, the lifecycle looks now (run.py sets it)
        self.on_gone: Callable[[], None] = lambda: None

    def listen(self, handler: Callable[[list], None], after: Callable[[], None]) -> None:
        self.handler, self.after = handler, after
        self.pump = Pump(self.loop, self.sock, handler, after=after)
        if self._ready is not None:
            self.loop.add_reader(self._ready.fileno(), self._read_lanes)

    def open_lane(self, identity: bytes) -> socket.socket | None:
        """A fresh lane for the worker life `identity`: its worker's end, for the spawn to pass
        and then close; None when the serving loops talk ZeroMQ (workers.doorbell: zmq)."""
        if self._ready is None:
            return None
        mine, theirs = doorbell.pair()
        old = self.lanes.get(identity)
        if old is not None:
            self._drop(old)
        lane = self.lanes[identity] = self._by_fd[mine.fileno()] = _Lane(self, identity, mine)
        self._ready.register(lane.fd, select.EPOLLIN)
        return theirs

    def _read_lanes(self) -> None:
        """Every lane with something to read (or at EOF), then the serving flush once."""
        for fd, _ in self._ready.poll(0):
            lane = self._by_fd.get(fd)
            if lane is not None and not lane.read():
                self._lost(lane)
        if self.after is not None:
            self.after()

    def _lost(self, lane: _Lane) -> None:
        """EOF on a lane: its worker is gone; the lifecycle looks at its exit on the next turn."""
        self._drop(lane)
        self.loop.call_soon(self.on_gone)

    def _drop(self, lane: _Lane) -> None:
        if self.lanes.get(lane.identity) is lane:
            del self.lanes[lane.identity]
        if self._by_fd.pop(lane.fd, None) is lane:
            self._ready.unregister(lane.fd)
        lane.close()

    def send(self, ident: bytes, msg) -> None:
        lane = self.lanes.get(ident)
        if lane is not None:
            lane.send(encode(msg))
        else:
            self.pump.send([ident, encode(msg)])

    def drain(self) -> None:
        """Read what workers sent now (a dying worker's last words before its death is handled)."""
        if self.pump is not None:
            self.pump.drain()
        if self._ready is not None and self.handler is not None:
            for lane in list(self.lanes.values()):
                if not lane.read():
                    self._lost(lane)
            self.after()

    def close(self) -> None:
        for lane in list(self.lanes.values()):
            self._drop(lane)
        if self._ready is not None:
            if self.handler is not None:
                self.loop.remove_reader(self._ready.fileno())
            self._ready.close()
            self._ready = None
        if self.pump is not None:
            self.pump.close()
        else:
            self.sock.close(linger=0)
