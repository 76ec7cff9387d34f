"""One KServe v2 tensor's data as JSON, both ways: a request's `data` (flat or nested lists) to
the bytes the ring takes, and a reply's frame to the `data` list (kserve.py has the bodies).

Datatypes map to tgw dtypes one to one; `BYTES` is tgw's bytes (JSON strings, UTF-8; binary:
each element a 4-byte little-endian length and its bytes, tgw's own layout, so a binary BYTES
input goes to the ring as it came) and `BF16` is bfloat16 (JSON numbers, rounded to nearest
even; binary: 2 bytes an element). No ml_dtypes here: bfloat16 is handled as its bit patterns.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from tgw.shm.bfloat16 import from_bfloat16_bits, to_bfloat16_bits
from tgw.shm.bytes_tensor import BytesTensorError, pack, unpack
from tgw.shm.errors import Code, TgwError, fail
from tgw.shm.wire import BYTES

DATATYPES = {"BOOL": "bool", "INT8": "int8", "INT16": "int16", "INT32": "int32", "INT64": "int64",
             "UINT8": "uint8", "UINT16": "uint16", "UINT32": "uint32", "UINT64": "uint64",
             "FP16": "float16", "FP32": "float32", "FP64": "float64", "BF16": "bfloat16", "BYTES": BYTES}
DATATYPE_OF = {dtype: name for name, dtype in DATATYPES.items()}
BFLOAT16 = "bfloat16"
# the JSON element kinds numpy infers that each tensor kind takes: ints never take floats
TAKES = {"b": "b", "i": "iu", "u": "iu", "f": "iuf"}


def bad(message: str, code: Code = Code.INVALID_ARGUMENT, **details) -> TgwError:
    return fail(code, message, **details)


def datatype(value: Any, name: str) -> str:
    dtype = DATATYPES.get(value) if isinstance(value, str) else None
    if dtype is None:
        raise bad(f"input {name!r}: datatype {value!r} must be one of {', '.join(DATATYPES)}",
                  Code.INVALID_INPUT_DTYPE, input=name, got=value)
    return dtype


def json_tensor(data: Any, dtype: str, shape: list[int], name: str) -> memoryview:
    """The raw bytes of a JSON tensor: flat or nested lists of numbers (true/false for BOOL,
    strings for BYTES)."""
    if not isinstance(data, list):
        raise bad(f"input {name!r}: \"data\" must be a list", input=name)
    if dtype == BYTES:
        return json_bytes(data, shape, name)
    want = math.prod(shape)
    try:
        found = np.asarray(data)
    except ValueError as exc:   # ragged nesting
        raise bad(f"input {name!r}: \"data\" is not a regular array: {exc}", Code.INVALID_INPUT_SHAPE,
                  input=name) from None
    if found.size != want:
        raise bad(f"input {name!r}: \"data\" holds {found.size} values; shape {shape} needs {want}",
                  Code.INVALID_INPUT_SHAPE, input=name, got=found.size, expected=want)
    target = np.dtype("float32" if dtype == BFLOAT16 else dtype)   # bfloat16: rounded from float32
    if want and found.dtype.kind not in TAKES[target.kind]:
        raise bad(f"input {name!r}: {DATATYPE_OF[dtype]} data must be "
                  f"{'true/false' if target.kind == 'b' else 'integers' if target.kind in 'iu' else 'numbers'}, "
                  f"got {kinds(found.dtype.kind)}", Code.INVALID_INPUT_DTYPE, input=name)
    try:
        with np.errstate(over="ignore"):   # past a float type's range is infinity, as a cast has it
            arr = found.astype(target, copy=False)
    except OverflowError as exc:
        raise bad(f"input {name!r}: {exc}", input=name) from None
    if target.kind in "iu" and want and not np.array_equal(arr, found):
        raise bad(f"input {name!r}: values out of the range of {DATATYPE_OF[dtype]}", input=name)
    if dtype == BFLOAT16:
        arr = to_bfloat16_bits(arr)
    return memoryview(np.ascontiguousarray(arr).reshape(-1)).cast("B")


def json_bytes(data: list, shape: list[int], name: str) -> memoryview:
    """A BYTES tensor's JSON strings (flat or nested, row-major) in tgw's bytes layout, UTF-8."""
    items: list = []
    _strings(data, items, name)
    want = math.prod(shape)
    if len(items) != want:
        raise bad(f"input {name!r}: \"data\" holds {len(items)} strings; shape {shape} needs {want}",
                  Code.INVALID_INPUT_SHAPE, input=name, got=len(items), expected=want)
    return memoryview(pack(items))


def _strings(data: list, out: list, name: str) -> None:
    for item in data:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, list):
            _strings(item, out, name)
        else:
            raise bad(f"input {name!r}: BYTES data must be strings (UTF-8 text; send other bytes with the binary "
                      f"extension), got {type(item).__name__}", Code.INVALID_INPUT_DTYPE, input=name)


def kinds(kind: str) -> str:
    return {"b": "booleans", "i": "integers", "u": "integers", "f": "floats"}.get(kind, "strings or objects")


def json_data(name: str, dtype: str, shape: list[int], frame) -> Any:
    """A reply's output as JSON `data`: a numpy array (orjson writes it), or a list of strings
    for BYTES; refused when an element is no UTF-8 text (the binary extension carries it)."""
    if dtype == BFLOAT16:   # as float64: its shortest repr is the bfloat16's exact value
        return from_bfloat16_bits(np.frombuffer(frame, dtype="<u2")).astype(np.float64)
    if dtype != BYTES:
        return np.frombuffer(frame, dtype=dtype)
    try:
        items = unpack(frame, math.prod(shape))
    except BytesTensorError as exc:   # the broker's own slice of a stage's output: a bug
        raise fail(Code.INTERNAL, f"output {name!r} is not a well-formed bytes tensor: {exc}", output=name) from None
    try:
        return [item.decode("utf-8") for item in items]
    except UnicodeDecodeError as exc:
        raise bad(f"output {name!r} holds bytes that are not UTF-8 text ({exc.reason} at byte {exc.start} of an "
                  "element), which JSON cannot carry: ask for it in binary (the output's parameters.binary_data: "
                  "true, or the request's binary_data_output: true)", output=name, reason="bytes_not_utf8") from None
