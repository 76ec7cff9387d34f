"""A request tensor's bytes as the ring takes them: the frame itself, or what it encodes.

Everything here is bounded by the declared shape, never by the frame: a small frame must not
make the broker allocate gigabytes (limits.py checks the declared sizes first).
"""
from __future__ import annotations

import lz4.frame

from tgw.shm.errors import Code, fail
from tgw.shm.wire import TensorMeta, nbytes_of


def tensor_bytes(meta: TensorMeta, buf: memoryview) -> memoryview:
    """The raw little-endian bytes of `meta`'s declared dtype and shape."""
    if meta.compression is None:
        return buf
    return inflate(meta, buf)


def inflate(meta: TensorMeta, buf: memoryview) -> memoryview:
    """Its lz4 frame inflated to exactly the declared size."""
    want = nbytes_of(meta.dtype, meta.shape)
    inflater = lz4.frame.LZ4FrameDecompressor()
    try:  # never inflate past the declared size: a small frame must not cost gigabytes
        raw = inflater.decompress(buf, max_length=want)
    except RuntimeError as exc:
        raise fail(Code.INVALID_ARGUMENT, f"input {meta.name!r}: bad lz4 frame: {exc}", input=meta.name) from None
    if len(raw) != want or not inflater.eof:
        raise fail(Code.INVALID_ARGUMENT, f"input {meta.name!r}: lz4 frame does not decompress to the "
                   f"{want} bytes that shape {meta.shape} x {meta.dtype} needs", input=meta.name)
    return memoryview(raw)
