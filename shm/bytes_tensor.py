"""Variable-length `bytes` tensors: how their elements lie in a frame, in the ring and in an
output arena (docs/PROTOCOL.md, "bytes tensors").

Each element, in C order, is a 4-byte little-endian unsigned length followed by that many
bytes: KServe v2's binary `BYTES` layout, as tritonclient sends it, so an HTTP body's tensor
goes to the ring as it came. A batch of requests' bytes tensors is their frames one after the
other (the layout is self-delimiting), and a request's rows are cut out of an output by byte
offsets (`BlockTensor.cuts`). Reading never trusts a length: every one is checked against the
bytes that remain and the element limit before anything is sliced.
"""
from __future__ import annotations

import math
import struct
from typing import Iterable, Optional, Union

BYTES = "bytes"            # the dtype's name on the wire, in configs and in IOSpec
PREFIX = 4                 # bytes of each element's length
_LEN = struct.Struct("<I")


class BytesTensorError(ValueError):
    """A frame that is not `count` well-formed elements; the message says where and why."""


def element(item: Union[bytes, bytearray, memoryview, str]) -> bytes:
    """One element as bytes: str is UTF-8 encoded."""
    if isinstance(item, str):
        return item.encode("utf-8")
    if isinstance(item, (bytes, bytearray, memoryview)):
        return bytes(item)
    raise TypeError(f"a bytes tensor holds bytes or str elements, not {type(item).__name__}")


def pack(items: Iterable) -> bytes:
    """The layout of `items` (bytes or str, in C order)."""
    parts = []
    for item in items:
        data = element(item)
        if len(data) > 0xFFFFFFFF:
            raise BytesTensorError(f"an element of {len(data)} bytes is longer than a 4-byte length can say")
        parts.append(_LEN.pack(len(data)))
        parts.append(data)
    return b"".join(parts)


def starts(buf, count: int, max_element: Optional[int] = None) -> list[int]:
    """Where each of the `count` elements' data begins in `buf` (after its length), and the
    end of the last (count + 1 entries); BytesTensorError unless `buf` is exactly that many
    well-formed elements, none longer than `max_element`."""
    view = memoryview(buf).cast("B") if not isinstance(buf, (bytes, bytearray)) else buf
    total, pos = len(view), 0
    out = []
    for k in range(count):
        if pos + PREFIX > total:
            raise BytesTensorError(f"element {k} of {count}: the data ends at byte {total}, inside its 4-byte "
                                   "length")
        (n,) = _LEN.unpack_from(view, pos)
        if max_element is not None and n > max_element:
            raise BytesTensorError(f"element {k} is {n} bytes long; the limit is {max_element} bytes an element")
        pos += PREFIX
        if pos + n > total:
            raise BytesTensorError(f"element {k} says it is {n} bytes long, but only {total - pos} bytes follow "
                                   "its length")
        out.append(pos)
        pos += n
    if pos != total:
        raise BytesTensorError(f"{total - pos} bytes follow the last of the {count} elements the shape calls for")
    out.append(pos + PREFIX)   # so element k is view[out[k]:out[k + 1] - PREFIX] for every k
    return out


def unpack(buf, count: int, max_element: Optional[int] = None) -> list[bytes]:
    """The `count` elements of `buf`, checked as `starts` checks them."""
    at = starts(buf, count, max_element)
    view = memoryview(buf).cast("B") if not isinstance(buf, (bytes, bytearray)) else buf
    return [bytes(view[at[k]:at[k + 1] - PREFIX]) for k in range(count)]


def row_cuts(buf, shape: list[int]) -> list[int]:
    """Byte offsets where each row (the first dim) of a well-formed tensor of `shape` begins in
    `buf`, and its end: rows + 1 entries."""
    rows = shape[0] if shape else 1
    per_row = math.prod(shape[1:]) if shape else 1
    at = starts(buf, rows * per_row)
    return [at[r * per_row] - PREFIX for r in range(rows)] + [len(buf)]


def element_count(shape: list[int]) -> int:
    return math.prod(shape)
