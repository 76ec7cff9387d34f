"""What every face shares about requests that answer many times and requests that step a
sequence: the request parameters that ask for them, and the caller that takes several answers.

* `sequence_ref(params)`: Triton's sequence parameters (`sequence_id` uint64 or string,
  `sequence_start`, `sequence_end`) as the request's SequenceRef (docs/SEQUENCES.md); the
  same names over HTTP's JSON parameters and gRPC's typed ones.
* `generate_params(params)`: a generation's limits and sampling from request parameters
  (`max_tokens` or `max_outputs`, `temperature`, `top_k`, `top_p`, `seed`, `stop_tokens`),
  as the Triton generate extension and a decoupled gRPC stream send them.
* `StreamCaller`: a caller the door answers many times (GenerateOutputs ... GenerateEnd, or one
  reply, or an error); a face reads its answers in order with `next()`. A face whose reader
  falls `max_unread` outputs behind has its stream ended OVERLOADED and withdrawn from the door
  (its slot freed), as a slow native reader's is.
"""
from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, Callable

import numpy as np

from tgw.shm.errors import Code, TgwError, error_from_body, fail
from tgw.shm.wire import BYTES, ErrorReply, GenerateOutputs, GenerateParams, Sampling, SequenceRef

from .errors import bad

SEQUENCE_KEYS = ("sequence_id", "sequence_start", "sequence_end")
GENERATE_KEYS = ("max_tokens", "max_outputs", "temperature", "top_k", "top_p", "seed", "stop_tokens")
U64 = 1 << 64


def _flag(params: dict, key: str) -> bool:
    value = params.get(key, False)
    if type(value) is not bool:
        raise bad(f"parameter {key} must be a boolean, got {value!r}", parameter=key)
    return value


def sequence_ref(params: dict) -> SequenceRef | None:
    """The request's sequence (None: it names none). Triton's id 0 or "" means no sequence, so a
    start or end flag without a real id is refused."""
    if not any(k in params for k in SEQUENCE_KEYS):
        return None
    cid = params.get("sequence_id", 0)
    start, end = _flag(params, "sequence_start"), _flag(params, "sequence_end")
    if isinstance(cid, bool) or not isinstance(cid, (int, str)) or (type(cid) is int and not 0 <= cid < U64):
        raise bad(f"parameter sequence_id must be a uint64 or a string, got {cid!r}", parameter="sequence_id")
    if cid == 0 or cid == "":
        if start or end:
            raise bad("parameter sequence_start/sequence_end needs a non-zero or non-empty sequence_id",
                      parameter="sequence_id")
        return None
    return SequenceRef(id=cid, start=start, end=end)


def _number(params: dict, key: str, kind: type, default):
    value = params.get(key, default)
    if value is default:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise bad(f"parameter {key} must be {'a number' if kind is float else 'an integer'}, got {value!r}",
                  parameter=key)
    return kind(value)


def generate_params(params: dict) -> GenerateParams:
    """A generation's GenerateParams from request parameters (admission checks the ranges)."""
    if "max_tokens" in params and "max_outputs" in params:
        raise bad("parameters max_tokens and max_outputs are one limit: send one", parameter="max_tokens")
    n = _number(params, "max_tokens", int, None)
    n = _number(params, "max_outputs", int, None) if n is None else n
    stops = params.get("stop_tokens", [])
    if isinstance(stops, int) and not isinstance(stops, bool):
        stops = [stops]
    if not isinstance(stops, list) or any(type(t) is not int for t in stops):
        raise bad(f"parameter stop_tokens must be an integer or a list of integers, got {stops!r}",
                  parameter="stop_tokens")
    sampling = Sampling(temperature=_number(params, "temperature", float, 0.0), top_k=_number(params, "top_k", int, 0),
                        top_p=_number(params, "top_p", float, 1.0), seed=_number(params, "seed", int, None),
                        stop_tokens=stops)
    return GenerateParams(max_outputs=n, sampling=sampling)


def output_arrays(msg: GenerateOutputs, frames: list) -> dict[str, np.ndarray]:
    """A GenerateOutputs' tensors as arrays ([count, *shape] each), by output name."""
    out = {}
    for meta, frame in zip(msg.outputs, frames):
        if meta.dtype == BYTES:
            raise fail(Code.INTERNAL, f"output {meta.name!r}: a generator's outputs are numeric")
        out[meta.name] = np.frombuffer(frame, dtype=meta.dtype).reshape(meta.shape)
    return out


class StreamCaller:
    """A caller the door answers several times. `next()` gives each answer in order: a
    GenerateOutputs with its frames (bytes), a plain reply with its frames, then the stream's
    GenerateEnd; an ErrorReply is raised as its TgwError. After the last answer `done` is set."""
    __slots__ = ("_queue", "_waiter", "_loop", "max_unread", "unread", "done", "on_overflow")
    face = "stream"

    def __init__(self, loop: asyncio.AbstractEventLoop, max_unread: int = 1024,
                 on_overflow: Callable[["StreamCaller"], None] | None = None):
        """`on_overflow(caller)`: the reader fell `max_unread` outputs behind (the face withdraws
        the caller from the door, so its sequence is cancelled and its slot freed)."""
        self._loop, self.max_unread, self.on_overflow = loop, max_unread, on_overflow
        self._queue: deque = deque()
        self._waiter: asyncio.Future | None = None
        self.unread = 0
        self.done = False

    def deliver(self, msg, frames) -> None:
        if self.done:
            return
        if type(msg) is GenerateOutputs:
            self.unread += msg.count
            if self.unread > self.max_unread:
                self.done = True
                self._queue.clear()
                self._put((ErrorReply(v=msg.v, id=msg.id, error=fail(
                    Code.OVERLOADED, f"the reader fell more than {self.max_unread} outputs behind: stream ended",
                    reason="slow_reader").to_body()), []))
                if self.on_overflow is not None:
                    self.on_overflow(self)
                return
        else:   # anything else is the last answer: a GenerateEnd, a plain reply, an error
            self.done = True
        self._put((msg, [bytes(f) for f in frames]))

    def _put(self, item) -> None:
        self._queue.append(item)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def next(self) -> tuple[Any, list[bytes]]:
        """The next answer (waits for it); an error answer raised."""
        while not self._queue:
            self._waiter = self._loop.create_future()
            await self._waiter
            self._waiter = None
        msg, frames = self._queue.popleft()
        if type(msg) is GenerateOutputs:
            self.unread -= msg.count
        elif type(msg) is ErrorReply:
            raise error_from_body(msg.error)
        return msg, frames

    @property
    def finished(self) -> bool:
        """Every answer was read (the last one included)."""
        return self.done and not self._queue

    def __repr__(self) -> str:
        return self.face


def is_end(msg) -> bool:
    """Whether an answer `next()` gave is the stream's last (a GenerateEnd, or a plain reply)."""
    return type(msg) is not GenerateOutputs


__all__ = ["StreamCaller", "sequence_ref", "generate_params", "output_arrays", "is_end", "TgwError",
           "SEQUENCE_KEYS", "GENERATE_KEYS"]
