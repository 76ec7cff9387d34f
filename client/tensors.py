"""Turning caller tensors into wire frames and reply frames into numpy arrays.

This runs once per tensor per call, so the common case (a C-contiguous numpy array of a dtype
tgw carries, in native little-endian order) takes a short path: the dtype's wire name comes
from a dict (numpy's `dtype.name` is Python code costing about 2 µs) and the bytes view is a
plain memoryview cast. Anything else takes the general path, with the same results.
"""
from __future__ import annotations

import lz4.frame
import numpy as np

from tgw.shm.errors import Code, fail
from tgw.shm.wire import DTYPE_SIZES, TensorMeta

ZERO_COPY_MIN = 64 * 1024  # below this, zmq copying is cheaper than tracking a borrowed buffer

# dtype -> wire name for the dtypes tgw carries, in native (= little-endian here) byte order;
# a dtype that compares equal to one of these (int64 vs longlong) has the same name
_NAMES = {np.dtype(n): n for n in DTYPE_SIZES} if np.little_endian else {}
# wire name -> the little-endian dtype a reply's bytes are read as
_READ_AS = {n: np.dtype(n).newbyteorder("<") for n in DTYPE_SIZES}


def as_array(name: str, value) -> np.ndarray:
    """C-contiguous little-endian numpy array; torch tensors are converted without importing torch."""
    return _as_array(name, value)[0]


def _as_array(name: str, value) -> tuple[np.ndarray, str]:
    """as_array and the array's wire dtype name."""
    if type(value) is np.ndarray:
        wire = _NAMES.get(value.dtype)
        if wire is not None and value.flags.c_contiguous:
            return value, wire
    elif type(value).__module__.startswith("torch"):
        value = value.detach().cpu().numpy()
    arr = np.asarray(value)
    if arr.dtype.name not in DTYPE_SIZES:
        raise fail(Code.INVALID_INPUT_DTYPE, f"input {name!r} has dtype {arr.dtype}; tgw carries "
                   f"{', '.join(DTYPE_SIZES)}", input=name)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    arr = np.ascontiguousarray(arr)
    return arr, arr.dtype.name


def encode(inputs: dict, compress: bool) -> tuple[list[TensorMeta], list, int, int]:
    """encode_inputs plus the tensors' raw bytes (what the header declares) and the bytes sent."""
    if not isinstance(inputs, dict) or not inputs:
        raise fail(Code.INVALID_ARGUMENT, "inputs must be a non-empty dict of name -> array")
    metas, frames, declared, sent = [], [], 0, 0
    for name, value in inputs.items():
        arr, wire = _as_array(name, value)
        try:
            data = memoryview(arr).cast("B")  # bytes view, no copy
        except (TypeError, ValueError):  # 0-d arrays, formats memoryview cannot cast
            data = memoryview(arr.reshape(-1).view(np.uint8))
        n = data.nbytes
        declared += n
        if compress:
            data = lz4.frame.compress(data)
            sent += len(data)
            metas.append(TensorMeta(name=name, dtype=wire, shape=list(arr.shape), compression="lz4"))
        else:
            sent += n
            metas.append(TensorMeta(name=name, dtype=wire, shape=list(arr.shape)))
        frames.append(data)
    return metas, frames, declared, sent


def encode_inputs(inputs: dict, compress: bool) -> tuple[list[TensorMeta], list]:
    metas, frames, _, _ = encode(inputs, compress)
    return metas, frames


def decode_outputs(metas: list[TensorMeta], frames: list) -> dict[str, np.ndarray]:
    """Arrays over the received frames (read-only, no copy unless decompressed)."""
    out = {}
    for meta, frame in zip(metas, frames):
        buf = frame.buffer if hasattr(frame, "buffer") else frame
        if meta.compression == "lz4":
            buf = lz4.frame.decompress(buf)
        dtype = _READ_AS.get(meta.dtype)
        if dtype is None:
            dtype = np.dtype(meta.dtype).newbyteorder("<")
        out[meta.name] = np.frombuffer(buf, dtype=dtype).reshape(meta.shape)
    return out
