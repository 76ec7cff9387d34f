"""The wire contract's shared parts: the message base, tensor descriptions, errors, names.

tgw.shm.wire is where every message is imported from; this module, wire_worker and
wire_control hold parts of the one contract (split only to keep modules small).
"""
from __future__ import annotations

from typing import Any, Optional

import msgspec

PROTOCOL_VERSION = 2
# versions whose requests this broker serves: a version-1 request is a subset of version 2
# (docs/PROTOCOL.md section 6, compatibility)
SUPPORTED_VERSIONS = (1, 2)

# Tensor dtypes tgw accepts, by numpy name; bytes per element.
DTYPE_SIZES: dict[str, int] = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8,
    "uint16": 2, "uint32": 4, "uint64": 8,   # torch carries these (few ops take them: models cast first)
    "float16": 2, "float32": 4, "float64": 8,
    "bfloat16": 2,   # numpy holds it as ml_dtypes.bfloat16 (client side); torch.bfloat16 in workers
}
# ... and the variable-length one: each element a byte string (shm/bytes_tensor.py has its layout)
BYTES = "bytes"
DTYPES = (*DTYPE_SIZES, BYTES)
COMPRESSIONS = ("lz4",)
# reduced wire precisions of a float32 tensor (TensorMeta.wire_dtype), with their bytes per element
WIRE_DTYPES: dict[str, int] = {"float16": 2, "bfloat16": 2}


# gc=False: a message is never tracked by the cyclic collector (docs/OPERATIONS.md#garbage-collection):
# decoded from bytes it holds only plain data (numbers, strings, lists and dicts of them, other
# messages), so it cannot sit in a reference cycle, and a request's messages add nothing to the
# count that triggers a collection. A message type that user code fills gets gc=True back.
class Struct(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=False, gc=False):
    pass


class CudaIpc(Struct):
    """A CUDA tensor shared by CUDA IPC handle (torch.multiprocessing's reduction of it): the
    tensor is `shape`/`dtype` of its TensorMeta, C-contiguous, starting `offset_bytes` into a
    storage of `storage_bytes` on CUDA device `device`, which `handle` opens in another process."""
    device: int                        # the device's index in the broker box's CUDA numbering
    device_uuid: str                   # the device's UUID, so both sides mean the same GPU
    handle: bytes                      # cudaIpcMemHandle of the storage's allocation
    storage_bytes: int
    storage_offset_bytes: int          # where the storage starts in that allocation
    offset_bytes: int = 0              # where the tensor starts in the storage
    ref_counter_handle: bytes = b""    # torch's shared reference counter (keeps the block alive)
    ref_counter_offset: int = 0
    event_handle: bytes = b""          # cudaIpcEventHandle: wait on it before reading
    event_sync_required: bool = False


class TensorMeta(Struct):
    name: str
    dtype: str
    shape: list[int]
    compression: Optional[str] = None  # "lz4": the frame is an lz4 frame of the raw bytes
    # "float16" | "bfloat16": a float32 tensor sent at that precision (frame: 2 bytes per element)
    wire_dtype: Optional[str] = None
    region: Optional[int] = None       # the bytes are in this registered shared-memory region (empty frame)
    offset: int = 0                    # ... starting here
    cuda: Optional[CudaIpc] = None     # the bytes are this CUDA tensor (empty frame)


class ErrorBody(Struct):
    code: str
    message: str
    retryable: bool = False
    details: dict[str, Any] = {}


class IOSpec(Struct):
    name: str
    dtype: str
    shape: list[int]  # without the batch dimension; -1 = variable
    reshape: Optional[list[int]] = None   # the model's own shape of it (Triton's reshape), when it differs



def model_key(name: str, version: str) -> str:
    """How workers and the broker name one loaded version: "name:version"."""
    return f"{name}:{version}"


def split_model_key(key: str) -> tuple[str, str]:
    name, version = key.split(":", 1)
    return name, version


def nbytes_of(dtype: str, shape: list[int]) -> int:
    """Bytes of a fixed-size dtype's tensor (KeyError for `bytes`: its size is its frame's)."""
    n = DTYPE_SIZES[dtype]
    for dim in shape:
        n *= dim
    return n


def as_builtins(obj: Any) -> Any:
    """A message as plain dicts and lists with every field, defaults included (msgspec's
    to_builtins leaves defaults out, as the wire does): for JSON output and callers' dicts."""
    if isinstance(obj, msgspec.Struct):
        config = obj.__struct_config__   # a message keeps its tag ("op")
        tag = {config.tag_field: config.tag} if config.tag_field else {}
        return {**tag, **{f: as_builtins(getattr(obj, f)) for f in obj.__struct_fields__}}
    if isinstance(obj, (list, tuple)):
        return [as_builtins(x) for x in obj]
    if isinstance(obj, dict):
        return {k: as_builtins(v) for k, v in obj.items()}
    return obj
