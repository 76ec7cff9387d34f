"""Triton's inputs and outputs as tgw tensor declarations: data types, dims, format, reshape,
label files; and the PyTorch backend's positional NAME__N order."""
from __future__ import annotations

import os
import re

from tgw.broker.faces.grpc.proto import model_config_pb2 as mc

from .notes import Notes

DTYPE_OF = {"TYPE_BOOL": "bool", "TYPE_UINT8": "uint8", "TYPE_UINT16": "uint16", "TYPE_UINT32": "uint32",
            "TYPE_UINT64": "uint64", "TYPE_INT8": "int8", "TYPE_INT16": "int16", "TYPE_INT32": "int32",
            "TYPE_INT64": "int64", "TYPE_FP16": "float16", "TYPE_FP32": "float32", "TYPE_FP64": "float64",
            "TYPE_BF16": "bfloat16", "TYPE_STRING": "bytes"}
INDEXED = re.compile(r"^(.+)__(\d+)$")


def dtype(value: int, field: str, notes: Notes) -> str | None:
    name = mc.DataType.Name(value)
    if name not in DTYPE_OF:
        notes.refuse(field, f"{name}: tgw's types are {', '.join(DTYPE_OF)}")
        return None
    return DTYPE_OF[name]


def dims(values, field: str, notes: Notes) -> list[int]:
    out = list(values)
    if any(d == 0 or d < -1 for d in out):
        notes.refuse(field, f"{out}: each dim is positive or -1 (variable)")
    return out


def tensor(t, kind: str, model_dir: str, notes: Notes) -> dict:
    """One ModelInput/ModelOutput as a TensorDecl-shaped dict."""
    where = f"{kind} {t.name}"
    out: dict = {"name": t.name, "dtype": dtype(t.data_type, f"{where}: data_type", notes),
                 "shape": dims(t.dims, f"{where}: dims", notes)}
    if t.HasField("reshape"):
        out["reshape"] = dims(t.reshape.shape, f"{where}: reshape", notes)
    if t.is_shape_tensor:
        notes.refuse(f"{where}: is_shape_tensor", "shape tensors are TensorRT's; tgw has none")
    if t.is_non_linear_format_io:
        notes.refuse(f"{where}: is_non_linear_format_io", "TensorRT's non-linear I/O formats are not tgw's")
    if kind == "input":
        if t.format != mc.ModelInput.FORMAT_NONE:
            out["format"] = mc.ModelInput.Format.Name(t.format)
        if t.allow_ragged_batch:
            notes.refuse(f"{where}: allow_ragged_batch", "tgw batches rows of one shape; a ragged batch would "
                         "reach the model differently")
        if t.optional:
            notes.warn(f"{where}: optional", "tgw needs every declared input in each request")
    elif t.label_filename:
        path = os.path.join(model_dir, t.label_filename)
        if not os.path.isfile(path):
            notes.refuse(f"{where}: label_filename", f"{path} not found")
        out["labels"] = os.path.abspath(path)
    return out


def positional(tensors: list[dict]) -> list[dict]:
    """The PyTorch backend's order: when every name is NAME__N, by N (the forward's N-th argument,
    the returned tuple's N-th item); otherwise as declared."""
    found = [INDEXED.match(t["name"]) for t in tensors]
    if not tensors or not all(found):
        return tensors
    return [t for _, t in sorted(zip((int(m.group(2)) for m in found), tensors), key=lambda p: p[0])]


def indexed_problem(tensors: list[dict]) -> str | None:
    """NAME__N names whose N are not 0..n-1 once each (the backend could not bind them)."""
    found = [INDEXED.match(t["name"]) for t in tensors]
    if not tensors or not all(found):
        return None
    indexes = sorted(int(m.group(2)) for m in found)
    return None if indexes == list(range(len(tensors))) else \
        f"indexes {indexes} of the NAME__N names are not 0..{len(tensors) - 1} once each"
