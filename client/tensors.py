"""Turning caller tensors into wire frames and reply frames into numpy arrays.

This runs once per tensor per call, so the common case (a C-contiguous numpy array of a dtype
tgw carries, in native little-endian order) takes a short path: the dtype's wire name comes
from a dict (numpy's `dtype.name` is Python code costing about 2 µs) and the bytes view is a
plain memoryview cast. Anything else takes the general path, with the same results.

`compress`: True lz4-compresses every tensor, "auto" those the shared rule picks
(tgw.shm.compression: large and compressible enough). `wire_dtype` ("float16" or "bfloat16")
sends float32 tensors at that precision (2 bytes an element; the broker widens them back to
float32, for models whose config lists it in `wire_dtypes`); other dtypes travel as they are.

`bytes` tensors (numpy arrays of bytes or str, or nested lists of them: client/bytes_tensors.py)
travel in the layout of tgw.shm.bytes_tensor; bfloat16 ones (ml_dtypes.bfloat16 arrays, torch
bfloat16 tensors) as their 2-byte bit patterns, and come back as ml_dtypes.bfloat16 arrays.
"""
from __future__ import annotations

import sys

import lz4.frame
import numpy as np

from tgw.shm.bfloat16 import from_bfloat16_bits, to_bfloat16_bits  # noqa: F401 - tgw.client.tensors' names too
from tgw.shm.compression import worth_compressing
from tgw.shm.errors import Code, fail
from tgw.shm.wire import BYTES, DTYPE_SIZES, WIRE_DTYPES, TensorMeta

from .bytes_tensors import decode_bytes, encode_bytes, is_bytes_value

ZERO_COPY_MIN = 64 * 1024  # below this, zmq copying is cheaper than tracking a borrowed buffer
BFLOAT16 = "bfloat16"      # numpy has no such dtype: ml_dtypes.bfloat16 holds it (imported when needed)


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a fixed-size wire dtype name: bfloat16 is ml_dtypes' (imported only
    here: it costs ~70 ms, and only callers who send or receive bfloat16 need it)."""
    if name == BFLOAT16:
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


# dtype -> wire name for the dtypes tgw carries, in native (= little-endian here) byte order;
# a dtype that compares equal to one of these (int64 vs longlong) has the same name
_NAMES = {np.dtype(n): n for n in DTYPE_SIZES if n != BFLOAT16} if np.little_endian else {}
# wire name -> the little-endian dtype a reply's bytes are read as (bfloat16: added when first read)
_READ_AS = {n: np.dtype(n).newbyteorder("<") for n in DTYPE_SIZES if n != BFLOAT16}


def as_array(name: str, value) -> np.ndarray:
    """C-contiguous little-endian numpy array; torch tensors are converted without importing torch."""
    return _as_array(name, value)[0]


def _as_array(name: str, value, wire_dtype: str | None = None) -> tuple[np.ndarray, str]:
    """as_array and the array's wire dtype name. A CPU torch tensor becomes a numpy array over
    the same memory (a copy only when it is not contiguous). A bfloat16 one (torch's, or a numpy
    array of ml_dtypes.bfloat16) becomes its bits (uint16, wire name "bfloat16")."""
    if type(value) is np.ndarray:
        wire = _NAMES.get(value.dtype)
        if wire is not None and value.flags.c_contiguous:
            return value, wire
    elif type(value).__module__.startswith("torch"):
        value = value.detach().cpu()   # CUDA tensors are copied to the host here
        if str(value.dtype) == "torch.bfloat16":
            import torch  # the caller passed a torch tensor: torch is loaded already
            return np.ascontiguousarray(value.view(torch.int16).numpy().view(np.uint16)), BFLOAT16
        value = value.resolve_conj().resolve_neg().numpy()   # shares the tensor's memory
    arr = np.asarray(value)
    if arr.dtype.name == BFLOAT16:   # ml_dtypes': a buffer numpy's memoryview cannot cast, so its bits
        return np.ascontiguousarray(arr).view("<u2"), BFLOAT16
    if arr.dtype.name not in DTYPE_SIZES:
        raise fail(Code.INVALID_INPUT_DTYPE, f"input {name!r} has dtype {arr.dtype}; tgw carries "
                   f"{', '.join(DTYPE_SIZES)} (ml_dtypes.bfloat16 arrays for bfloat16) and bytes (numpy arrays "
                   "or lists of bytes or str)", input=name)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    arr = np.ascontiguousarray(arr)
    return arr, arr.dtype.name


def to_float16(arr: np.ndarray) -> np.ndarray:
    """float32 -> float16, rounded to nearest even. numpy's cast is slow (~4.8 ms for 4 MiB here,
    no SIMD); torch's is ~60 times faster and gives the same values, so it is used when the
    caller's process has loaded torch already (tgw.client never imports it)."""
    torch = sys.modules.get("torch")
    if torch is not None and arr.flags.writeable and hasattr(torch, "from_numpy"):
        return torch.from_numpy(arr).half().numpy()
    with np.errstate(over="ignore"):
        return arr.astype("<f2")


def narrow(arr: np.ndarray, wire: str, wire_dtype: str | None) -> tuple[np.ndarray, str, str | None]:
    """The array to send, its dtype and its wire_dtype: a float32 array at `wire_dtype`. Under a
    wire_dtype, a bfloat16 tensor counts as the float32 tensor of its values (exact), as it did
    before tgw carried bfloat16: at wire_dtype bfloat16 its bits go as they are."""
    if wire_dtype is None:
        return arr, wire, None
    if wire == BFLOAT16:
        if wire_dtype == BFLOAT16:
            return arr, "float32", BFLOAT16
        return to_float16(from_bfloat16_bits(arr)), "float32", "float16"
    if wire != "float32":     # only float32 travels narrowed
        return arr, wire, None
    if wire_dtype == "float16":   # past float16's range (65504) is infinity, as float16 has it
        return to_float16(arr), "float32", "float16"
    return to_bfloat16_bits(arr), "float32", BFLOAT16


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
        if is_bytes_value(value):   # variable-length elements: their layout (wire_dtype is not for them)
            shape, data = encode_bytes(name, value)
            dtype, narrowed, n = BYTES, None, len(data)
        else:
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
    """Arrays over the received frames (read-only, no copy unless decompressed); a bytes output
    as an object array of `bytes`, a bfloat16 one as ml_dtypes.bfloat16."""
    out = {}
    for meta, frame in zip(metas, frames):
        buf = frame.buffer if hasattr(frame, "buffer") else frame
        if meta.compression == "lz4":
            buf = lz4.frame.decompress(buf)
        if meta.dtype == BYTES:
            out[meta.name] = decode_bytes(meta.name, buf, meta.shape)
            continue
        dtype = _READ_AS.get(meta.dtype)
        if dtype is None:
            dtype = _READ_AS[meta.dtype] = numpy_dtype(meta.dtype).newbyteorder("<")
        out[meta.name] = np.frombuffer(buf, dtype=dtype).reshape(meta.shape)
    return out
