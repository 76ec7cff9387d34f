"""The broker's link to its workers: the ZeroMQ back socket, and each worker life's lane.

Every worker thread has a DEALER on the back socket (a ROUTER): the beacon (heartbeats,
snapshots) and the loader (run-time loads) always talk there. The serving loop's messages -
the hello and its answer, Batch, Done, Release, Withdraw, Steps, Stop - are on the per-batch
path, and with `workers.doorbell: socket` (the default) they take the worker life's lane
instead (shm/doorbell.py: a socketpair, no ZeroMQ I/O thread on either side); with `zmq` they
stay on the back socket, as before the lanes.

A lane is opened at each spawn (`open_lane`, the supervisor's hook) and dies with its worker:
what it sent before is read first, then EOF closes the lane and asks the lifecycle to look at
the worker's exit now (`on_gone`; its pidfd usually says the same a moment later). Both paths
hand each message to the same handler, as [identity, body] frames, and call `after` (the
serving flush) once a read pass ends.
"""
from __future__ import annotations

import asyncio
import logging
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
        self.reading = self.closed = False

    def start(self) -> None:
        if not self.reading and not self.closed:
            self.reading = True
            self.link.loop.add_reader(self.fd, self.drain)

    def drain(self) -> None:
        """Hand every whole message waiting to the handler; at EOF, the lane closes."""
        if self.closed or self.link.handler is None:
            return
        frames = [_Frame(self.identity), _Frame(None)]
        handler, inbox, sock, eof = self.link.handler, self.inbox, self.sock, False
        for _ in range(READS):
            try:
                n = inbox.fill(sock)
            except BlockingIOError:
                break
            except ConnectionError:
                n = 0
            while (msg := inbox.take()) is not None:
                frames[1].buffer = msg
                try:
                    handler(frames)
                except Exception:  # one bad message must not stall the rest
                    log.exception("handler failed on a message; continuing")
            if not n:
                eof = True
                break
        if eof:
            self.link.lost(self)
        if self.link.after is not None:
            self.link.after()

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
        if self.reading:
            self.link.loop.remove_reader(self.fd)
        if self.out:
            self.link.loop.remove_writer(self.fd)
            self.out = bytearray()
        self.sock.close()


class WorkerLink:
    """Built with the sockets, so placement and the memory watch can be given `send`; it listens
    once the core that handles what workers send exists."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: zmq.Socket, doorbell_kind: str = "zmq"):
        """`doorbell_kind`: workers.doorbell ("socket": lanes for the serving loops; "zmq": none)."""
        self.loop, self.sock = loop, sock
        self.lanes_on = doorbell_kind == "socket"
        self.pump: Pump | None = None
        self.handler: Callable[[list], None] | None = None
        self.after: Callable[[], None] | None = None
        self.lanes: dict[bytes, _Lane] = {}   # worker life's identity -> its lane, until EOF
        # a lane's EOF: its worker exited, the lifecycle looks now (run.py sets it)
        self.on_gone: Callable[[], None] = lambda: None

    def listen(self, handler: Callable[[list], None], after: Callable[[], None]) -> None:
        self.handler, self.after = handler, after
        self.pump = Pump(self.loop, self.sock, handler, after=after)
        for lane in self.lanes.values():
            lane.start()

    def open_lane(self, identity: bytes) -> socket.socket | None:
        """A fresh lane for the worker life `identity`: its worker's end, for the spawn to pass
        and then close; None when the serving loops talk ZeroMQ (workers.doorbell: zmq)."""
        if not self.lanes_on:
            return None
        mine, theirs = doorbell.pair()
        old = self.lanes.pop(identity, None)
        if old is not None:
            old.close()
        lane = self.lanes[identity] = _Lane(self, identity, mine)
        if self.handler is not None:
            lane.start()
        return theirs

    def lost(self, lane: _Lane) -> None:
        """EOF on a lane: its worker is gone; the lifecycle looks at its exit on the next turn."""
        lane.close()
        if self.lanes.get(lane.identity) is lane:
            del self.lanes[lane.identity]
        self.loop.call_soon(self.on_gone)

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
        for lane in list(self.lanes.values()):
            lane.drain()

    def close(self) -> None:
        for lane in list(self.lanes.values()):
            lane.close()
        self.lanes.clear()
        if self.pump is not None:
            self.pump.close()
        else:
            self.sock.close(linger=0)
