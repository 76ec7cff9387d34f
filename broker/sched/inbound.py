"""A request tensor's bytes as the ring takes them: the frame itself, or what it encodes (an lz4
frame inflated; a float32 tensor sent at a reduced precision, `wire_dtype`, widened back).

Everything here is bounded by the declared shape, never by the frame: a small frame must not
make the broker allocate gigabytes (limits.py checks the declared sizes first). A `bytes`
tensor has no declared size: its lz4 frame inflates to at most server.max_request_bytes, and
its layout is checked (shm/bytes_tensor.py: exactly the shape's element count, every length in
bounds and at most server.max_element_bytes, nothing after the last) before it is queued.
"""
from __future__ import annotations

import functools
import math
import operator

import lz4.frame
import numpy as np

from tgw.shm.bytes_tensor import PREFIX, BytesTensorError, starts
from tgw.shm.errors import Code, fail
from tgw.shm.wire import BYTES, TensorMeta

from tgw.broker.models.checks import wire_nbytes


class CheckedFrame:
    """A tensor frame the broker itself holds, already in the ring's layout: a pipeline step's
    output (pipeline/run.py), which its worker checked (a stage's bytes outputs in
    workers/stage_outputs.py, a model's in the runner) and never compressed or narrowed, so
    admission takes its bytes as they are. `.buffer` and len() in bytes, as a frame."""
    __slots__ = ("buffer",)

    def __init__(self, buffer: memoryview):
        self.buffer = buffer

    def __len__(self) -> int:
        return self.buffer.nbytes


def tensor_bytes(meta: TensorMeta, buf: memoryview, server=None) -> memoryview:
    """The raw little-endian bytes of `meta`'s declared dtype and shape (validated: registry.py
    checked the frame's size, dtype and wire_dtype); a bytes tensor's layout, checked against
    `server`'s limits (ServerDecl: max_request_bytes, max_element_bytes)."""
    if meta.dtype == BYTES:
        return bytes_tensor(meta, buf, server.max_request_bytes, server.max_element_bytes)
    if meta.compression is not None:
        buf = inflate(meta, buf)
    if meta.wire_dtype is not None:
        buf = widen(meta.wire_dtype, buf)
    return buf


def widen(wire_dtype: str, buf) -> memoryview:
    """float16 or bfloat16 bytes -> the float32 bytes of the same values (exact)."""
    if wire_dtype == "float16":   # a table of all 65536: half the time of numpy's cast
        wide = np.take(_float16_table(), np.frombuffer(buf, dtype="<u2"))
    else:   # bfloat16: the top half of a float32
        wide = np.frombuffer(buf, dtype="<u2").astype("<u4")
        wide <<= 16
    return memoryview(wide).cast("B")


@functools.cache
def _float16_table() -> np.ndarray:
    """float32 of every float16 bit pattern (256 KiB)."""
    return np.arange(1 << 16, dtype="<u2").view("<f2").astype("<f4")


def inflate(meta: TensorMeta, buf: memoryview) -> memoryview:
    """Its lz4 frame inflated to exactly the size sent (wire_nbytes)."""
    want = wire_nbytes(meta)
    inflater = lz4.frame.LZ4FrameDecompressor()
    try:  # never inflate past the declared size: a small frame must not cost gigabytes
        raw = inflater.decompress(buf, max_length=want)
    except RuntimeError as exc:
        raise fail(Code.INVALID_ARGUMENT, f"input {meta.name!r}: bad lz4 frame: {exc}", input=meta.name) from None
    if len(raw) != want or not inflater.eof:
        what = meta.dtype if meta.wire_dtype is None else f"{meta.wire_dtype} (wire_dtype)"
        raise fail(Code.INVALID_ARGUMENT, f"input {meta.name!r}: lz4 frame does not decompress to the "
                   f"{want} bytes that shape {meta.shape} x {what} needs", input=meta.name)
    return memoryview(raw)


def bytes_tensor(meta: TensorMeta, buf, max_bytes: int, max_element: int) -> memoryview:
    """A bytes tensor's frame (inflated, to at most `max_bytes`), refused unless it is exactly
    the elements its shape calls for, none over `max_element` bytes."""
    if meta.compression is not None:
        inflater = lz4.frame.LZ4FrameDecompressor()
        try:   # one byte past the limit tells "too large" from "exactly the limit"
            raw = inflater.decompress(buf, max_length=max_bytes + 1)
        except RuntimeError as exc:
            raise fail(Code.INVALID_ARGUMENT, f"input {meta.name!r}: bad lz4 frame: {exc}", input=meta.name) from None
        if len(raw) > max_bytes:
            raise fail(Code.PAYLOAD_TOO_LARGE, f"input {meta.name!r}: its lz4 frame inflates past {max_bytes} bytes "
                       "(server.max_request_bytes)", input=meta.name, limit=max_bytes)
        if not inflater.eof:
            raise fail(Code.INVALID_ARGUMENT, f"input {meta.name!r}: the lz4 frame ends before its end mark",
                       input=meta.name)
        buf = memoryview(raw)
    count = math.prod(meta.shape)
    try:
        at = starts(buf, count)
    except BytesTensorError as exc:
        raise fail(Code.INVALID_ARGUMENT, f"input {meta.name!r} (bytes, shape {meta.shape}: {count} elements, each "
                   f"a 4-byte little-endian length and its bytes): {exc}", input=meta.name,
                   reason="bytes_layout") from None
    longest = max(map(operator.sub, at[1:], at), default=PREFIX) - PREFIX
    if longest > max_element:
        raise fail(Code.PAYLOAD_TOO_LARGE, f"input {meta.name!r}: an element is {longest} bytes long; the limit is "
                   f"{max_element} bytes an element (server.max_element_bytes)", input=meta.name,
                   limit=max_element, got=longest)
    return buf if isinstance(buf, memoryview) else memoryview(buf)
