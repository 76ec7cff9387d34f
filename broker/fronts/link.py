"""A front process's end of the fronts socket: one ZeroMQ DEALER to the hub's ROUTER on
`ipc://<run dir>/fronts` (wire.py), read on the loop without an await per message.

Its routing id is `front-<index>-<pid>`, so the hub tells one life of a front from the next.
The hub's messages are handed to a handler by their kind frame. The broker gone is noticed at
once: its end of the Unix socket closes (a hung broker: ZeroMQ's heartbeat times out), which
the socket's monitor reports as a disconnect; `lost` is then called, once.
"""
from __future__ import annotations

import asyncio
import logging
import os
import struct
from typing import Callable

import zmq

from tgw.broker.front.sockets import MORE, NOBLOCK, Pump

log = logging.getLogger("tgw.broker")
HEARTBEAT_IVL_MS = 1000       # a ping this often while the link is quiet
HEARTBEAT_TIMEOUT_MS = 3000   # no traffic for this long: the broker is taken for gone
COPY_BELOW = 1 << 16          # smaller frames are copied into the message; larger ones sent zero-copy


def endpoint(run_dir: str) -> str:
    return f"ipc://{os.path.join(run_dir, 'fronts')}"


class Link:
    def __init__(self, loop: asyncio.AbstractEventLoop, ctx: zmq.Context, address: str, index: int,
                 handlers: dict[bytes, Callable[[list], None]], lost: Callable[[str], None]):
        """`handlers`: kind -> handler of the whole message's frames (zmq frames); `lost`: the
        broker is gone (its reason)."""
        self.handlers, self.lost = handlers, lost
        self.identity = f"front-{index}-{os.getpid()}"
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, self.identity.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)   # never dropped nor refused: the broker's admission is the bound
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.connected = False
        self.gone = False
        sock.connect(address)
        self.sock = sock
        self._send = sock.send
        self.pump = Pump(loop, sock, self.handle)
        self.watch = Pump(loop, monitor, self.on_event)

    def handle(self, frames: list) -> None:
        handler = self.handlers.get(frames[0].bytes)
        if handler is None:
            log.warning("front: a message of unknown kind %r from the hub, dropped", frames[0].bytes[:8])
            return
        handler(frames)

    def on_event(self, frames: list) -> None:
        event = struct.unpack_from("=H", frames[0].bytes)[0]
        if event == zmq.EVENT_CONNECTED:
            self.connected = True
        elif event == zmq.EVENT_DISCONNECTED and not self.gone:
            self.gone = True
            self.lost("the fronts socket closed (the broker exited, or its heartbeat timed out)")

    def send(self, frames: list) -> None:
        """Queue one message to the hub (never blocks: no high-water mark)."""
        send, last = self._send, len(frames) - 1
        try:
            for i, f in enumerate(frames):
                size = f.nbytes if type(f) is memoryview else len(f)
                send(f, MORE if i < last else NOBLOCK, copy=size < COPY_BELOW)
        except zmq.ZMQError as exc:   # closed or refused: the broker is going; `lost` follows
            log.warning("front: cannot send to the hub: %s", exc)
        finally:
            self.pump.kick()   # a send may consume the FD's edge: look again

    def close(self) -> None:
        self.watch.close()
        self.pump.close()
