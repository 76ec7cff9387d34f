"""The broker's end of the fronts socket: one ROUTER on `ipc://<run dir>/fronts`, read on the
broker's loop as the client socket is (sockets.py's Pump: edge-triggered, NOBLOCK drains, no
await per message, the serving flush after each pass so requests of every front read in one
pass are batched together).

A front process's life (one pid) is one caller at the front door, a `FrontCaller`: the door
tracks its requests by (caller, the front's request id) as it tracks a socket identity's, and
answers them through `deliver`, which sends [ident, REPLY, reply, *frames] (copied: the frames
are ring views released after the call). A front is not a client: the per-client limits
(max_clients, max_inflight_per_client) are not its (`unbounded`); the front applies its own
callers' limits. When a life ends - its process exited, seen by the fleet (fleet.py) - every
request it had admitted leaves unrun (abandoned, reason "front_gone"): queued, on a worker, a
pipeline's run or a running generation, as the door drops any caller's.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import msgspec
import zmq

from tgw.shm.wire import Goodbye, Infer, RegisterRegion, UnregisterRegion, encode, request_decoder

from tgw.broker.front.sockets import Pump

from . import wire
from .directory import DirectoryBook

log = logging.getLogger("tgw.broker")
GONE = "front_gone"   # the abandon reason of a dead front's requests

_hello = msgspec.msgpack.Decoder(wire.FrontHello)
_withdraw = msgspec.msgpack.Decoder(wire.FrontWithdraw)
_count = msgspec.msgpack.Decoder(wire.FrontCount)
_note = msgspec.msgpack.Decoder(wire.FrontNote)
_stats = msgspec.msgpack.Decoder(wire.FrontStats)


@dataclass(frozen=True)
class HubRoutes:
    """What the hub calls of the broker (the assembly hands the front door's and its neighbours')."""
    infer: Callable[[Any, Infer, list], None]      # door.infer: admits or answers the refusal
    dispatch: Callable[[Any, Any], None]           # door.dispatch: any other client message
    withdraw: Callable[[Any, list, str], int]      # abandon.drop_ids: these requests leave unrun (reason)
    drop_caller: Callable[[Any, str], int]         # door.drop_caller: every request of a caller leaves
    count_error: Callable[[str | None, str], None]  # stats.error
    note: Callable[..., None]                      # complaints.note
    flush: Callable[[], None]                      # the serving flush, after each drain pass
    # door.regions.handle: a front's (un)registration of its region (fronts/region.py), the
    # message's frame as the header (its Peer-Address names the front's pid and uid); None: refused
    regions: Callable[[Any, Any, Any], None] | None = None


class FrontCaller:
    """One front life at the door (a socket identity's stand-in)."""
    __slots__ = ("send", "ident", "index", "pid", "stats", "ended")
    face = "front"
    unbounded = True   # not a client: max_inflight_per_client is not its (sched/admission.py Owed)

    def __init__(self, send: Callable[[list], tuple], ident: bytes, index: int, pid: int):
        self.send, self.ident, self.index, self.pid = send, ident, index, pid
        self.stats = wire.FrontStats(inflight=0, requests=0, forwarded=0)
        self.ended = False

    def deliver(self, msg, frames) -> None:
        if not self.ended:   # pyzmq copies each frame (no zero-copy send): the ring views may go after
            self.send([self.ident, wire.REPLY, encode(msg), *frames])

    def __repr__(self) -> str:
        return f"front {self.index} (pid {self.pid})"


class FrontsHub:
    def __init__(self, loop, sock: zmq.Socket):
        """Built from its socket alone (so the fleet and status can read it); opened last."""
        self.loop, self.sock = loop, sock
        self.routes: HubRoutes | None = None   # until open
        self.book: DirectoryBook | None = None
        self.lives: dict[bytes, FrontCaller] = {}     # routing id -> its life, from HELLO to its end
        self.by_index: dict[int, FrontCaller] = {}    # the current life of each index that said HELLO
        self.on_hello: Callable[[int, int], None] = lambda index, pid: None   # the fleet's (index, pid)
        self.pump: Pump | None = None
        self.handlers: dict = {}

    def open(self, routes: HubRoutes, book: DirectoryBook) -> None:
        """Start reading: the door is open, every part a message reaches exists."""
        self.routes, self.book = routes, book
        self.handlers = {wire.INFER: self._request, wire.ASK: self._request, wire.WITHDRAW: self._withdraw,
                         wire.COUNT: self._count, wire.NOTE: self._note, wire.STATS: self._stats,
                         wire.DIRECTORY: self._directory_asked}
        self.pump = Pump(self.loop, self.sock, self.on_message, after=routes.flush)

    # ---- messages ------------------------------------------------------------------------------

    def on_message(self, frames: list) -> None:
        if len(frames) < 2:
            return   # not a front's message (only the broker's own children reach this socket)
        ident, kind = frames[0].bytes, frames[1].bytes
        life = self.lives.get(ident)
        if life is None:
            if kind == wire.HELLO:
                return self._hello(ident, frames)
            return   # a life already ended (its last messages, read after its exit): nobody to answer
        handler = self.handlers.get(kind)
        if handler is None:
            self.routes.note("refused", "front_message", f"{life!r} sent an unknown message kind {kind!r}")
            return
        handler(life, frames)

    def _hello(self, ident: bytes, frames: list) -> None:
        hello = _hello.decode(frames[2].buffer)
        old = self.by_index.get(hello.index)
        if old is not None:   # its previous life's exit not seen yet: it is over all the same
            self.end(hello.index, old.pid, read_first=False)   # (inside a drain pass already)
        life = FrontCaller(self.pump.send, ident, hello.index, hello.pid)
        self.lives[ident] = self.by_index[hello.index] = life
        if self.book.refresh(force_header=True):
            self.publish()   # changed: every front hears of it, the new one too
        else:
            self._send_directory(life)
        self.on_hello(hello.index, hello.pid)

    def _request(self, life: FrontCaller, frames: list) -> None:
        """INFER or ASK: a client message, as the native door reads it (an infer by either kind).
        The kind frame stands as the header: every frame of a message read on an ipc:// ROUTER
        carries the sender's Peer-Address, which resolves the front's region slices."""
        msg = request_decoder.decode(frames[2].buffer)
        if type(msg) is Infer:
            self.routes.infer(life, msg, frames[3:], frames[1])
        elif type(msg) is RegisterRegion or type(msg) is UnregisterRegion:
            if self.routes.regions is not None:
                self.routes.regions(life, msg, frames[1])
            else:
                self.routes.note("refused", "front_message", f"{life!r} sent a region: this hub takes none")
        elif type(msg) is Goodbye:   # would drop every request of the front: its callers withdraw by id
            self.routes.note("refused", "front_message", f"{life!r} sent a bye (WITHDRAW names its requests)")
        else:
            self.routes.dispatch(life, msg)

    def _withdraw(self, life: FrontCaller, frames: list) -> None:
        msg = _withdraw.decode(frames[2].buffer)
        self.routes.withdraw(life, msg.ids, msg.reason)

    def _count(self, life: FrontCaller, frames: list) -> None:
        msg = _count.decode(frames[2].buffer)
        self.routes.count_error(msg.model, msg.code)

    def _note(self, life: FrontCaller, frames: list) -> None:
        msg = _note.decode(frames[2].buffer)
        self.routes.note(msg.kind, msg.detail, msg.message)

    def _stats(self, life: FrontCaller, frames: list) -> None:
        life.stats = _stats.decode(frames[2].buffer)

    def _directory_asked(self, life: FrontCaller, frames: list) -> None:
        if self.book.refresh():
            self.publish()   # changed: everyone hears of it (the asker too)
        else:
            self._send_directory(life)

    # ---- the directory -------------------------------------------------------------------------

    def look(self) -> None:
        """The lifecycle's periodic look (and an operator's reply about to go): publish the
        directory if it changed."""
        if self.book is not None and self.book.refresh():
            self.publish()

    def publish(self) -> None:
        for life in self.lives.values():
            self._send_directory(life)

    def _send_directory(self, life: FrontCaller) -> None:
        self.pump.send([life.ident, wire.DIRECTORY, wire.encoder.encode(self.book.current)])

    # ---- lives ---------------------------------------------------------------------------------

    def end(self, index: int, pid: int, read_first: bool = True) -> int:
        """The life of front `index` with `pid` is over (its process exited): its last messages
        are read first, then every request it had admitted leaves unrun (GONE); how many."""
        life = self.by_index.get(index)
        if life is None or life.pid != pid:
            return 0
        if read_first and self.pump is not None:
            self.pump.drain()   # what it sent before it died, admitted or answered first
        life.ended = True
        del self.by_index[index]
        self.lives.pop(life.ident, None)
        dropped = self.routes.drop_caller(life, GONE)
        if dropped:
            log.warning("front %d (pid %d) exited with %d request(s) admitted: withdrawn unrun", index, pid, dropped,
                        extra={"event": "front_gone", "index": index, "pid": pid, "withdrawn": dropped})
        return dropped

    def drain_all(self) -> None:
        """Tell every front to stop accepting and finish what is open (the broker is stopping)."""
        for life in self.lives.values():
            self.pump.send([life.ident, wire.DRAIN])

    def life(self, index: int) -> FrontCaller | None:
        return self.by_index.get(index)

    def close(self) -> None:
        for life in self.lives.values():
            life.ended = True
        if self.pump is not None:
            self.pump.close()
        else:
            self.sock.close(linger=0)
