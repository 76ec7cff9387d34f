"""`bytes` tensors on the client: what a caller hands over (numpy arrays of bytes or str, or
nested lists of them) as the wire's layout (tgw.shm.bytes_tensor: a 4-byte length before each
element), and a reply's bytes tensor as a numpy object array of `bytes`.

str elements are sent UTF-8 encoded; replies always hold `bytes` (decode them yourself: an
element need not be text).
"""
from __future__ import annotations

import math

import numpy as np

from tgw.shm.bytes_tensor import BytesTensorError, pack, unpack
from tgw.shm.errors import Code, fail

LEAVES = (bytes, bytearray, str)   # what a bytes tensor's elements may be
TEXT_KINDS = "OSU"                 # numpy kinds that hold bytes or str: object, bytes_, str_


def is_bytes_value(value) -> bool:
    """Whether the caller's `value` is a bytes tensor: a numpy array of bytes/str/objects, a bare
    bytes/str, or (nested) lists whose first element is bytes or str."""
    if type(value) is np.ndarray:
        return value.dtype.kind in TEXT_KINDS
    while isinstance(value, (list, tuple)):
        if not value:
            return False
        value = value[0]
    return isinstance(value, LEAVES)


def encode_bytes(name: str, value) -> tuple[list[int], bytes]:
    """The shape and the frame of a bytes tensor (is_bytes_value said it is one)."""
    if isinstance(value, np.ndarray):
        shape, items = list(value.shape), value.ravel(order="C").tolist()
    elif isinstance(value, LEAVES):
        shape, items = [], [value]
    else:
        shape = _nested_shape(value)
        items = []
        _flatten(name, value, shape, 0, items)
    for i, item in enumerate(items):
        if not isinstance(item, LEAVES):
            raise fail(Code.INVALID_INPUT_DTYPE, f"input {name!r} is a bytes tensor: element {i} (C order) is "
                       f"{type(item).__name__}, not bytes or str", input=name)
    try:
        return shape, pack(items)
    except BytesTensorError as exc:
        raise fail(Code.PAYLOAD_TOO_LARGE, f"input {name!r}: {exc}", input=name) from None


def _nested_shape(value) -> list[int]:
    shape = []
    while isinstance(value, (list, tuple)):
        shape.append(len(value))
        if not value:
            break
        value = value[0]
    return shape


def _flatten(name: str, value, shape: list[int], depth: int, out: list) -> None:
    """`value`'s leaves in C order into `out`, checking that it is a regular nesting of `shape`."""
    if depth == len(shape):
        if isinstance(value, (list, tuple)):
            raise fail(Code.INVALID_INPUT_SHAPE, f"input {name!r}: its lists nest deeper in some places than the "
                       f"first element's ({len(shape)} levels, shape {shape})", input=name)
        out.append(value)
        return
    if not isinstance(value, (list, tuple)) or len(value) != shape[depth]:
        got = len(value) if isinstance(value, (list, tuple)) else type(value).__name__
        raise fail(Code.INVALID_INPUT_SHAPE, f"input {name!r}: its lists are not a regular array of shape {shape} "
                   f"(level {depth} has {got} where the first element's has {shape[depth]})", input=name)
    for item in value:
        _flatten(name, item, shape, depth + 1, out)


def decode_bytes(name: str, buf, shape: list[int]) -> np.ndarray:
    """A reply's bytes tensor as a numpy object array of `shape`, each element `bytes`."""
    count = math.prod(shape)
    try:
        items = unpack(buf, count)
    except BytesTensorError as exc:
        raise fail(Code.INTERNAL, f"output {name!r} is not a well-formed bytes tensor of shape {shape}: {exc}",
                   output=name) from None
    out = np.empty(count, dtype=object)
    out[:] = items
    return out.reshape(shape)
