"""RemotePort: the DoorPort (protocol/door.py) of a face that runs in a front process, its calls
made into fronts-socket messages (wire.py) and the hub's replies delivered to the callers.

The faces hand the port their own callers and their own request ids (each face counts its
own, so two faces' ids may meet); the front gives every request an id of its own, unique in
this process's life, and restores the face's id on each reply before the caller sees it. A
request is remembered until its final reply (every reply but a generation's GenerateOutputs)
or until its caller withdraws it. The reads (`view`, `entry`) are the Mirror's; `load` is the
load report's header as the hub last sent it and whether this front drains; `shm` is None:
a request naming Triton's shared-memory regions is forwarded to the broker's own face whole.
"""
from __future__ import annotations

import logging
from itertools import count
from typing import Any, Callable

from tgw.shm.wire import GenerateOutputs, Infer, encode, reply_decoder

from tgw.broker.protocol.door import DoorPort

from . import wire
from .mirror import Mirror
from .region import FrontRegion

log = logging.getLogger("tgw.broker")
COPY_BELOW = 1 << 16   # frames smaller than this are copied into the message (zero-copy costs more for them)


class LoadView:
    """What a face reads of the load report: the header the hub last sent, and the drain."""
    __slots__ = ("header", "draining", "doc")

    def __init__(self):
        self.header = ""
        self.draining = False
        self.doc: dict = {}


class RemotePort:
    def __init__(self, send: Callable[[list], None], mirror: Mirror, token: str | None):
        """`send`: a multipart message to the hub, without blocking (link.Link.send)."""
        self.send, self.mirror = send, mirror
        self.ids = count(1)
        self.last_sent = 0                               # the newest front id handed out
        self.region: FrontRegion | None = None          # large inputs travel in it once registered (region.py)
        self.pending: dict[int, tuple[Any, int]] = {}   # front id -> (caller, the face's id)
        self.of_caller: dict[Any, list[int]] = {}       # caller -> its front ids in flight
        self.load = LoadView()
        self.door = DoorPort(token=token, view=mirror.view, entry=mirror.entry, dispatch=self.dispatch,
                             infer=self.infer, count_error=self.count_error, note=self.note,
                             withdraw=self.withdraw, shm=None, load=self.load)

    # ---- the door's calls --------------------------------------------------------------------

    def remember(self, caller, msg) -> tuple[int, int]:
        fid = self.last_sent = next(self.ids)
        face_id = msg.id
        self.pending[fid] = (caller, face_id)
        ids = self.of_caller.get(caller)
        if ids is None:
            self.of_caller[caller] = [fid]
        else:
            ids.append(fid)
        return fid, face_id

    def infer(self, caller, msg: Infer, frames: list, *route) -> None:
        """`frames`: the face's tensors (SliceFrame, or anything with `.buffer`); `route`: none
        here (no region is named on this side). Large inputs go into the front's region (a job's
        never: its inputs must travel in its message)."""
        bufs = [f.buffer for f in frames]   # all made before anything is sent
        fid, face_id = self.remember(caller, msg)
        msg.id = fid
        region, placed = self.region, None
        try:
            if region is not None and not msg.job:
                placed = region.place(fid, msg.inputs, bufs)
            header = encode(msg)
        except BaseException:
            self.forget(caller, fid)
            if placed:
                region.unsent(fid)
            raise
        finally:
            msg.id = face_id   # the face's request is its own again
            if placed:
                region.unmark(msg.inputs, placed)
        self.send([wire.INFER, header, *bufs])

    def dispatch(self, caller, msg) -> None:
        fid, face_id = self.remember(caller, msg)
        msg.id = fid
        try:
            header = encode(msg)
        except BaseException:
            self.forget(caller, fid)
            raise
        finally:
            msg.id = face_id
        self.send([wire.ASK, header])

    def withdraw(self, caller, reason: str) -> int:
        ids = self.of_caller.pop(caller, None)
        if not ids:
            return 0
        for fid in ids:
            self.pending.pop(fid, None)
        if self.region is not None:
            self.region.withdrawn(ids, self.last_sent)
        self.send([wire.WITHDRAW, wire.encoder.encode(wire.FrontWithdraw(ids=ids, reason=reason))])
        return len(ids)

    def count_error(self, model: str | None, code: str) -> None:
        self.send([wire.COUNT, wire.encoder.encode(wire.FrontCount(model=model, code=code))])

    def note(self, kind: str, detail: str, message: str, exc_info: bool = False) -> None:
        if exc_info:   # the stack is this process's: logged here, the complaint counted in the broker
            log.warning("front %s %s: %s", kind, detail, message, exc_info=True)
        self.send([wire.NOTE, wire.encoder.encode(wire.FrontNote(kind=kind, detail=detail, message=message))])

    # ---- the hub's replies -------------------------------------------------------------------

    def on_reply(self, frames: list) -> None:
        """[REPLY, reply, *tensor frames] (zmq frames): to the caller that asked, under its id."""
        msg = reply_decoder.decode(frames[1].buffer)
        fid = msg.id
        if self.region is not None:
            self.region.answered(fid)   # the broker reads its slots no more
        held = self.pending.get(fid)
        if held is None:   # withdrawn meanwhile: nobody waits for it
            return
        caller, face_id = held
        if type(msg) is not GenerateOutputs:   # every other reply is a request's last
            self.forget(caller, fid)
        msg.id = face_id
        caller.deliver(msg, [f.buffer for f in frames[2:]])

    def forget(self, caller, fid: int) -> None:
        del self.pending[fid]
        ids = self.of_caller.get(caller)
        if ids is not None:
            if len(ids) == 1:
                del self.of_caller[caller]
            else:
                ids.remove(fid)

    @property
    def inflight(self) -> int:
        return len(self.pending)
