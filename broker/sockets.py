"""ZeroMQ sockets on the asyncio (uvloop) loop without a per-message await.

ZeroMQ's FD is edge-triggered and only says "look at zmq.EVENTS": a reader drains with
NOBLOCK until zmq.Again, and anything that sends on a socket may consume that edge, so a
send schedules one more drain of the same socket.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

import zmq

log = logging.getLogger("tgw.broker")
DRAIN_CHUNK = 512  # messages handled before yielding to other sockets and timers
# plain ints: pyzmq's enum flags cost an enum operation per call on the hot path
NOBLOCK, POLLIN, EVENTS = int(zmq.NOBLOCK), int(zmq.POLLIN), int(zmq.EVENTS)


class Pump:
    def __init__(self, loop: asyncio.AbstractEventLoop, sock: zmq.Socket, handler: Callable[[list], None]):
        self.loop, self.sock, self.handler = loop, sock, handler
        self._scheduled = False
        self._fd = sock.getsockopt(zmq.FD)
        loop.add_reader(self._fd, self.drain)
        self.kick()  # messages may already be waiting: the edge could be gone

    def kick(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self.drain)

    def drain(self) -> None:
        self._scheduled = False
        if self.sock.closed:
            return
        sock, handler = self.sock, self.handler
        for _ in range(DRAIN_CHUNK):
            # reading EVENTS (not catching zmq.Again, which costs an exception per drain) also
            # re-arms the edge-triggered FD once nothing is left
            if not sock.getsockopt(EVENTS) & POLLIN:
                return
            frames = sock.recv_multipart(NOBLOCK, copy=False)
            try:
                handler(frames)
            except Exception:  # one bad message must not stall the rest of the queue
                log.exception("handler failed on a message; continuing")
        self.kick()  # more may be queued: continue on the next loop turn

    def send(self, frames: list, track: bool = False) -> tuple[str, object]:
        """Send without blocking: ("", tracker) once queued (tracker None unless `track`: zero-copy,
        then it tells when libzmq is done with the frames), else ("full", None) at the peer's
        high-water mark or ("gone", None) when no such peer is connected."""
        try:
            if track:
                return "", self.sock.send_multipart(frames, NOBLOCK, copy=False, track=True)
            self.sock.send_multipart(frames, NOBLOCK)
            return "", None
        except zmq.Again:
            return "full", None
        except zmq.ZMQError:
            return "gone", None
        finally:
            if not self.sock.closed:
                self.kick()

    def close(self) -> None:
        self.loop.remove_reader(self._fd)
        self.sock.close(linger=0)
