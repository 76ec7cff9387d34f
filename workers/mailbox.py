"""The serving loop's socket to the broker, and the messages read ahead of their turn.

While a batch waits for output space the worker must read on (a release may be coming); what it
reads meanwhile is parked here and taken, in order, before the socket is read again.
"""
from __future__ import annotations

from collections import deque

import zmq

from tgw.shm.wire import encode, to_worker_decoder


class Mailbox:
    def __init__(self, sock: zmq.Socket):
        self.sock = sock
        self.parked: deque = deque()

    def next(self):
        """The next message: a parked one first, else the next off the socket (blocking)."""
        if self.parked:
            return self.parked.popleft()
        return self.read()

    def read(self):
        """The next message off the socket, past any parked one (blocking)."""
        return to_worker_decoder.decode(self.sock.recv())

    def park(self, msg) -> None:
        self.parked.append(msg)

    def arrived(self, timeout_ms: int = 0) -> bool:
        """Whether a message is waiting on the socket (parked ones not counted)."""
        return bool(self.sock.poll(timeout_ms))

    def send(self, msg) -> None:
        self.sock.send(encode(msg))
