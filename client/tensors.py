"""Turning caller tensors into wire frames and reply frames into numpy arrays."""
from __future__ import annotations

import lz4.frame
import numpy as np

from tgw.shm.errors import Code, fail
from tgw.shm.wire import DTYPE_SIZES, TensorMeta

ZERO_COPY_MIN = 64 * 1024  # below this, zmq copying is cheaper than tracking a borrowed buffer


def as_array(name: str, value) -> np.ndarray:
    """C-contiguous little-endian numpy array; torch tensors are converted without importing torch."""
    if type(value).__module__.startswith("torch"):
        value = value.detach().cpu().numpy()
    arr = np.asarray(value)
    if arr.dtype.name not in DTYPE_SIZES:
        raise fail(Code.INVALID_INPUT_DTYPE, f"input {name!r} has dtype {arr.dtype}; tgw carries "
                   f"{', '.join(DTYPE_SIZES)}", input=name)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return np.ascontiguousarray(arr)


def encode_inputs(inputs: dict, compress: bool) -> tuple[list[TensorMeta], list]:
    if not isinstance(inputs, dict) or not inputs:
        raise fail(Code.INVALID_ARGUMENT, "inputs must be a non-empty dict of name -> array")
    metas, frames = [], []
    for name, value in inputs.items():
        arr = as_array(name, value)
        data = memoryview(arr.reshape(-1).view(np.uint8))  # bytes view, no copy
        if compress:
            data = lz4.frame.compress(data)
        metas.append(TensorMeta(name=name, dtype=arr.dtype.name, shape=list(arr.shape),
                                compression="lz4" if compress else None))
        frames.append(data)
    return metas, frames


def decode_outputs(metas: list[TensorMeta], frames: list) -> dict[str, np.ndarray]:
    """Arrays over the received frames (read-only, no copy unless decompressed)."""
    out = {}
    for meta, frame in zip(metas, frames):
        buf = frame.buffer if hasattr(frame, "buffer") else frame
        if meta.compression == "lz4":
            buf = lz4.frame.decompress(buf)
        out[meta.name] = np.frombuffer(buf, dtype=np.dtype(meta.dtype).newbyteorder("<")).reshape(meta.shape)
    return out
