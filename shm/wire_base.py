"""The wire contract's shared parts: the message base, tensor descriptions, errors, names.

tgw.shm.wire is where every message is imported from; this module, wire_worker and
wire_control hold parts of the one contract (split only to keep modules small).
"""
from __future__ import annotations

from typing import Any, Optional

import msgspec

PROTOCOL_VERSION = 1

# Tensor dtypes tgw accepts, by numpy name; bytes per element.
DTYPE_SIZES: dict[str, int] = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8,
    "uint16": 2, "uint32": 4, "uint64": 8,   # torch carries these (few ops take them: models cast first)
    "float16": 2, "float32": 4, "float64": 8,
}
COMPRESSIONS = ("lz4",)


class Struct(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=False):
    pass


class TensorMeta(Struct):
    name: str
    dtype: str
    shape: list[int]
    compression: Optional[str] = None  # "lz4": the frame is an lz4 frame of the raw bytes


class ErrorBody(Struct):
    code: str
    message: str
    retryable: bool = False
    details: dict[str, Any] = {}


class IOSpec(Struct):
    name: str
    dtype: str
    shape: list[int]  # without the batch dimension; -1 = variable



def model_key(name: str, version: str) -> str:
    """How workers and the broker name one loaded version: "name:version"."""
    return f"{name}:{version}"


def split_model_key(key: str) -> tuple[str, str]:
    name, version = key.split(":", 1)
    return name, version


def nbytes_of(dtype: str, shape: list[int]) -> int:
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
