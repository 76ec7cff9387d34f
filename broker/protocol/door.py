"""The one port through which a face reaches the broker's front door, and the caller a face
hands the door in place of a socket identity.

A face (faces/__init__.py) parses its protocol, calls the protocol layer for semantics and
reaches the rest of the broker only through a `DoorPort`: a frozen record of plain values and
callables, built by the core's assembly (core/assembly.py) from the front door and the parts
beside it, and taken by every face alike. Nothing in it names the `Broker` or a face.

Why a record of callables and not a typing.Protocol: the core fills it from parts that live in
different wings (the door, the stats, the complaints), and a face in another process (a later
issue's front processes) can be handed the same record with its calls made into messages. The
calls are already one-way with an answer that comes back by `caller.deliver(msg, frames)`
(dispatch, infer) or none (withdraw, count_error, note); the reads (view, entry, load, shm) are
the part such a face would answer from a copy or a query.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

from tgw.shm.errors import error_from_body
from tgw.shm.wire import ErrorReply, Infer

if TYPE_CHECKING:
    from tgw.broker.models.registry import ModelEntry
    from tgw.broker.observe.load import LoadReport
    from tgw.broker.observe.status import BrokerView

    from .triton_shm import TritonShm
    from .uploads import Uploads


class Caller(Protocol):
    """What the door answers in place of a socket identity: it calls deliver once per request
    with the reply message and its tensor frames (views valid only during the call)."""

    def deliver(self, msg, frames) -> None: ...


@dataclass(frozen=True)
class DoorPort:
    """What a face reads and calls of the rest of the broker."""
    token: str | None
    view: "BrokerView"                            # health, readiness, the repository index, /metrics
    entry: Callable[[str], "ModelEntry"]          # the registry's model by name; raises MODEL_NOT_FOUND
    dispatch: Callable[[Any, Any], None]          # the front door: a decoded request other than infer
    infer: Callable[[Any, Infer, list], None]     # the front door: an inference request (it answers refusals)
    count_error: Callable[[str, str], None]       # stats.error(model, code): refusals before the door, counted
    note: Callable[..., None]                     # complaints.note: a broker bug, logged rate-limited
    withdraw: Callable[[Any, str], int]           # the caller gave up (reason): its requests leave, unrun
    shm: "TritonShm | None" = None                # Triton's client shared memory, one registry for every face
    load: "LoadReport | None" = None              # the load report: its header on every response, /v2/load
    scrape: Callable[[], tuple[bytes, str]] = lambda: (b"", "text/plain")   # the /metrics exposition, its type
    uploads: "Uploads | None" = None              # where a load's files go (server.allow_model_uploads)


class AwaitedCaller:
    """One request's stand-in for a socket identity, awaited once: the door's answer resolves its
    future. The output bytes are copied out here, as the ring block is released right after.
    Each face names its own subclass (`face`, its repr in logs)."""
    __slots__ = ("future",)
    face = "face"

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.future = loop.create_future()

    def deliver(self, msg, frames) -> None:
        if not self.future.done():   # the handler may be gone (its connection closed, its call cancelled)
            self.future.set_result((msg, [bytes(f) for f in frames]))

    def __repr__(self) -> str:
        return self.face


async def ask(port: DoorPort, msg, caller: AwaitedCaller):
    """Send a message other than infer through the front door as a caller would; its answer
    (reply, frames), an error answer raised as its TgwError."""
    port.dispatch(caller, msg)
    reply, frames = await caller.future
    if isinstance(reply, ErrorReply):
        raise error_from_body(reply.error)
    return reply, frames
