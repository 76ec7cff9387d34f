"""The hard limits on what one request may declare, checked on the header alone: before any
tensor is sized, copied or inflated, so a few bytes on the wire cannot make the broker allocate
gigabytes (or overflow a size computation). Each refusal names its config key.

A `bytes` tensor's shape gives its element count (bounded by server.max_elements like any
other); its bytes are its frame's, which admission counts toward server.max_request_bytes, and
its layout is checked element by element before it is queued (inbound.bytes_tensor)."""
from __future__ import annotations

import math

from tgw.shm.errors import Code, fail
from tgw.shm.bytes_tensor import PREFIX
from tgw.shm.wire import BYTES, DTYPE_SIZES, Infer

from tgw.broker.config.schema import ServerDecl

WIDEST = max(DTYPE_SIZES.values())  # an unknown dtype is refused later; bound it by the widest meanwhile


def check_declared(msg: Infer, server: ServerDecl) -> int:
    """The decoded tensor bytes the request declares; raises when a limit is exceeded."""
    if len(msg.inputs) > server.max_tensors_per_request:
        raise fail(Code.INVALID_ARGUMENT, f"request declares {len(msg.inputs)} tensors; the limit is "
                   f"{server.max_tensors_per_request} (server.max_tensors_per_request)",
                   limit=server.max_tensors_per_request)
    total = 0
    for meta in msg.inputs:
        if len(meta.shape) > server.max_dims:
            raise fail(Code.INVALID_INPUT_SHAPE, f"input {meta.name!r} has {len(meta.shape)} dims; the limit is "
                       f"{server.max_dims} (server.max_dims)", input=meta.name, limit=server.max_dims)
        if any(d < 0 for d in meta.shape):
            raise fail(Code.INVALID_INPUT_SHAPE, f"input {meta.name!r} has a negative dim: {meta.shape}",
                       input=meta.name, got=meta.shape)
        elements = math.prod(meta.shape)
        if elements > server.max_elements:
            raise fail(Code.PAYLOAD_TOO_LARGE, f"input {meta.name!r} declares {elements} elements; the limit is "
                       f"{server.max_elements} per tensor (server.max_elements)", input=meta.name,
                       limit=server.max_elements)
        if meta.dtype == BYTES and elements > server.max_bytes_elements:   # each is checked one by one
            raise fail(Code.PAYLOAD_TOO_LARGE, f"bytes input {meta.name!r} declares {elements} elements; the limit "
                       f"is {server.max_bytes_elements} per bytes tensor (server.max_bytes_elements)",
                       input=meta.name, limit=server.max_bytes_elements)
        # a bytes tensor's size is its frame's (admission counts it): here the least it can be
        total += elements * (PREFIX if meta.dtype == BYTES else DTYPE_SIZES.get(meta.dtype, WIDEST))
    if total > server.max_request_bytes:
        raise fail(Code.PAYLOAD_TOO_LARGE, f"request declares {total} bytes of tensors once decoded; the limit "
                   f"is {server.max_request_bytes} (server.max_request_bytes)", declared=total,
                   limit=server.max_request_bytes)
    return total
