"""Turning caller tensors into wire frames and reply frames into numpy arrays.

This runs once per tensor per call, so the common case (a C-contiguous numpy array of a dtype
tgw carries, in native little-endian order) takes a short path: the dtype's wire name comes
from a dict (numpy's `dtype.name` is Python code costing about 2 µs) and the bytes view is a
plain memoryview cast. Anything else takes the general path, with the same results.

`compress`: True lz4-compresses every tensor, "auto" those the shared rule picks
(tgw.shm.compression: large and compressible enough). `wire_dtype` ("float16" or "bfloat16")
sends float32 tensors at that precision (2 bytes an element; the broker widens them back to
float32, for models whose config lists it in `wire_dtypes`); other dtypes travel as they are.
"""
from __future__ import annotations

import sys

import lz4.frame
import numpy as np

from tgw.shm.compression import worth_compressing
from tgw.shm.errors import Code, fail
from tgw.shm.wire import DTYPE_SIZES, WIRE_DTYPES, TensorMeta

ZERO_COPY_MIN = 64 * 1024  # below this, zmq copying is cheaper than tracking a borrowed buffer

# dtype -> wire name for the dtypes tgw carries, in native (= little-endian here) byte order;
# a dtype that compares equal to one of these (int64 vs longlong) has the same name
_NAMES = {np.dtype(n): n for n in DTYPE_SIZES} if np.little_endian else {}
# wire name -> the little-endian dtype a reply's bytes are read as
_READ_AS = {n: np.dtype(n).newbyteorder("<") for n in DTYPE_SIZES}


def as_array(name: str, value) -> np.ndarray:
    """C-contiguous little-endian numpy array; torch tensors are converted without importing torch."""
    return _as_array(name, value)[0]


def _as_array(name: str, value, wire_dtype: str | None = None) -> tuple[np.ndarray, str]:
    """as_array and the array's wire dtype name. A CPU torch tensor becomes a numpy array over
    the same memory (a copy only when it is not contiguous); a bfloat16 one, which numpy cannot
    hold, becomes its bits (uint16, wire name "bfloat16") when `wire_dtype` is "bfloat16", else
    float32 (exact: every bfloat16 is a float32)."""
    if type(value) is np.ndarray:
        wire = _NAMES.get(value.dtype)
        if wire is not None and value.flags.c_contiguous:
            return value, wire
    elif type(value).__module__.startswith("torch"):
        value = value.detach().cpu()   # CUDA tensors are copied to the host here
        if str(value.dtype) == "torch.bfloat16":
            if wire_dtype == "bfloat16":
                import torch  # the caller passed a torch tensor: torch is loaded already
                return np.ascontiguousarray(value.view(torch.int16).numpy().view(np.uint16)), "bfloat16"
            value = value.float()
        value = value.resolve_conj().resolve_neg().numpy()   # shares the tensor's memory
    arr = np.asarray(value)
    if arr.dtype.name not in DTYPE_SIZES:
        raise fail(Code.INVALID_INPUT_DTYPE, f"input {name!r} has dtype {arr.dtype}; tgw carries "
                   f"{', '.join(DTYPE_SIZES)}", input=name)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    arr = np.ascontiguousarray(arr)
    return arr, arr.dtype.name


def to_bfloat16_bits(arr: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest, ties to even (as torch
    does); infinities stay, values past bfloat16's largest round to infinity, NaN stays NaN
    (quiet, sign kept)."""
    u = np.ascontiguousarray(arr, dtype="<f4").view("<u4")
    rounded = u >> 16        # in place from here: a quarter of the time of the plain expression
    rounded &= 1
    rounded += 0x7FFF
    rounded += u             # wraps only for NaNs (set below)
    rounded >>= 16
    bits = rounded.astype("<u2")
    nan = np.isnan(arr)
    if nan.any():
        bits[nan] = ((u[nan] >> 16) | 0x0040).astype("<u2")
    return bits


def to_float16(arr: np.ndarray) -> np.ndarray:
    """float32 -> float16, rounded to nearest even. numpy's cast is slow (~4.8 ms for 4 MiB here,
    no SIMD); torch's is ~60 times faster and gives the same values, so it is used when the
    caller's process has loaded torch already (tgw.client never imports it)."""
    torch = sys.modules.get("torch")
    if torch is not None and arr.flags.writeable and hasattr(torch, "from_numpy"):
        return torch.from_numpy(arr).half().numpy()
    with np.errstate(over="ignore"):
        return arr.astype("<f2")


def from_bfloat16_bits(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32, exactly (what the broker does to such a frame)."""
    return (np.asarray(bits, dtype="<u2").astype("<u4") << 16).view("<f4")


def narrow(arr: np.ndarray, wire: str, wire_dtype: str | None) -> tuple[np.ndarray, str, str | None]:
    """The array to send, its dtype and its wire_dtype: a float32 array at `wire_dtype`."""
    if wire_dtype is None:
        return arr, wire, None
    if wire == "bfloat16":   # a bfloat16 torch tensor's bits, as they are
        return arr, "float32", "bfloat16"
    if wire != "float32":     # only float32 travels narrowed
        return arr, wire, None
    if wire_dtype == "float16":   # past float16's range (65504) is infinity, as float16 has it
        return to_float16(arr), "float32", "float16"
    return to_bfloat16_bits(arr), "float32", "bfloat16"


def _bytes(arr: np.ndarray) -> memoryview:
    try:
        return memoryview(arr).cast("B")  # bytes view, no copy
    except (TypeError, ValueError):  # 0-d arrays, formats memoryview cannot cast
        return memoryview(arr.reshape(-1).view(np.uint8))


def _lz4_len(part: memoryview) -> int:
    return len(lz4.frame.compress(part))


def encode(inputs: dict, compress: bool | str,
           wire_dtype: str | None = None) -> tuple[list[TensorMeta], list, int, int]:
    """encode_inputs plus the tensors' decoded bytes (what the header declares: float32 for a
    narrowed tensor) and the bytes sent."""
    if not isinstance(inputs, dict) or not inputs:
        raise fail(Code.INVALID_ARGUMENT, "inputs must be a non-empty dict of name -> array")
    if wire_dtype is not None and wire_dtype not in WIRE_DTYPES:
        raise fail(Code.INVALID_ARGUMENT, f"wire_dtype must be one of {list(WIRE_DTYPES)} or None, got "
                   f"{wire_dtype!r}", wire_dtype=wire_dtype)
    metas, frames, declared, sent = [], [], 0, 0
    for name, value in inputs.items():
        arr, wire = _as_array(name, value, wire_dtype)
        shape = list(arr.shape)
        arr, dtype, narrowed = narrow(arr, wire, wire_dtype)
        data = _bytes(arr)
        n = data.nbytes
        declared += n if narrowed is None else n * 2   # the broker widens it to float32
        compression = None
        if compress is True or (compress == "auto" and worth_compressing(data, _lz4_len)):
            packed = lz4.frame.compress(data)
            if compress is True or len(packed) < n:
                data, compression = packed, "lz4"
        sent += len(data) if compression else n
        metas.append(TensorMeta(name=name, dtype=dtype, shape=shape, compression=compression, wire_dtype=narrowed))
        frames.append(data)
    return metas, frames, declared, sent


def encode_inputs(inputs: dict, compress: bool | str,
                  wire_dtype: str | None = None) -> tuple[list[TensorMeta], list]:
    metas, frames, _, _ = encode(inputs, compress, wire_dtype)
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
