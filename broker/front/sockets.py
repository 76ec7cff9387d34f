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
NOBLOCK = int(zmq.NOBLOCK)
MORE = NOBLOCK | int(zmq.SNDMORE)


class Pump:
    def __init__(self, loop: asyncio.AbstractEventLoop, sock: zmq.Socket, handler: Callable[[list], None],
                 after: Callable[[], None] | None = None):
        """`handler` gets each message's frames; `after`, if given, runs once a drain pass ends
        (the broker forms batches there, one loop turn sooner than a call_soon would)."""
        self.loop, self.sock, self.handler, self.after = loop, sock, handler, after
        self._scheduled = False
        self._fd = sock.getsockopt(zmq.FD)
        # libzmq's send without pyzmq's Python-level wrapper (which only adds DRAFT routing_id/group)
        self._send = super(zmq.Socket, sock).send
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
        handler, recv = self.handler, self.sock.recv
        # until zmq.Again, which also re-arms the edge-triggered FD: one exception per pass costs
        # less than reading EVENTS before every message (pyzmq makes an enum of each read)
        try:
            for _ in range(DRAIN_CHUNK):
                # frame by frame: pyzmq sets each frame's `more` (recv_multipart asks the socket again)
                frame = recv(NOBLOCK, copy=False)
                frames = [frame]
                while frame.more:
                    frame = recv(NOBLOCK, copy=False)
                    frames.append(frame)
                try:
                    handler(frames)
                except Exception:  # one bad message must not stall the rest of the queue
                    log.exception("handler failed on a message; continuing")
            else:
                self.kick()  # more may be queued: continue on the next loop turn
        except zmq.Again:
            pass
        if self.after is not None:
            self.after()

    def send(self, frames: list, track: bool = False) -> tuple[str, object]:
        """Send without blocking: ("", tracker) once queued (tracker None unless `track`: zero-copy,
        then it tells when libzmq is done with the frames), else ("full", None) at the peer's
        high-water mark or ("gone", None) when no such peer is connected."""
        send, last = self._send, len(frames) - 1
        try:  # frame by frame with int flags: what send_multipart does, less its per-call overhead
            if track:
                for f in frames[:last]:
                    send(f, MORE, copy=False, track=True)
                return "", send(frames[last], NOBLOCK, copy=False, track=True)
            for f in frames[:last]:
                send(f, MORE)
            send(frames[last], NOBLOCK)
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
