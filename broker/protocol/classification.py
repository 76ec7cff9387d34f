"""Triton's classification extension: an output asked for with `classification: k` (HTTP output
parameter; gRPC's `class_count`, which tritonclient sends as the same parameter) is answered as
its top k classes instead of its values, each a BYTES element "value:index" or, when the output
has a label file (models[].outputs[].labels), "value:index:label".

As Triton's server does it (src/classification.cc, http_server.cc): per batch row when the model
has a batch dim (shape [rows, k]; else [k]), k capped at the elements of a row, highest value
first, the value written as C++'s std::to_string writes it ("%f" for floats, "%d" for integers);
FP16, BF16, BOOL and BYTES outputs are refused with Triton's message.
"""
from __future__ import annotations

import math
from typing import Any

import msgspec
import numpy as np

from tgw.shm.bytes_tensor import pack
from tgw.shm.wire import BYTES, InferReply, TensorMeta

from .errors import bad

PARAMETER = "classification"
MAX_ELEMENTS = 1_000_000   # Triton's kMaxClassificationElements
UNCLASSIFIABLE = {"float16": "FP16", "bfloat16": "BF16", "bool": "BOOL", BYTES: "BYTES"}   # Triton's names
CLASSIFIABLE = {"uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64", "float32", "float64"}


def class_count(params: dict, name: str, shm: bool) -> int:
    """An output's requested class count (0: its values, as usual)."""
    if PARAMETER not in params:
        return 0
    if shm:
        raise bad("Output can't set both 'shared_memory_region' and 'classification'", output=name)
    k = params[PARAMETER]
    if type(k) is not int or k < 0:
        raise bad(f"Unable to set 'classification': output {name!r} needs a non-negative integer, got {k!r}",
                  output=name, parameter=PARAMETER)
    return k


def value_text(value: Any, kind: str) -> str:
    """std::to_string's rendering: "%f" for floating types, the integer itself otherwise."""
    return f"{float(value):f}" if kind == "f" else str(int(value))


def top_k(values: np.ndarray, k: int, labels: list[str] | None) -> list[str]:
    """One row's top k as Triton's strings (ties: the lower index first)."""
    flat = values.reshape(-1)
    if flat.size > MAX_ELEMENTS:
        raise bad("classification output tensor too large")
    order = np.argsort(-flat.astype(np.float64), kind="stable")[:min(k, flat.size)]
    out = []
    for idx in order.tolist():
        text = f"{value_text(flat[idx], flat.dtype.kind)}:{idx}"
        if labels is not None and idx < len(labels):
            text += f":{labels[idx]}"
        out.append(text)
    return out


def classified(reply: InferReply, frames: list, classes: dict[str, int], batched: bool,
               labels: dict[str, list[str]]) -> tuple[InferReply, list]:
    """The reply with each output named in `classes` replaced by its top-k BYTES tensor."""
    if not classes:
        return reply, frames
    metas, out = [], []
    for meta, frame in zip(reply.outputs, frames):
        k = classes.get(meta.name, 0)
        if not k:
            metas.append(meta)
            out.append(frame)
            continue
        if meta.dtype not in CLASSIFIABLE:
            raise bad(f"class result not available for output due to unsupported type "
                      f"'{UNCLASSIFIABLE.get(meta.dtype, meta.dtype)}'", output=meta.name)
        arr = np.frombuffer(frame, dtype=meta.dtype)
        rows = meta.shape[0] if batched and meta.shape else 0
        per_row = math.prod(meta.shape[1:] if rows else meta.shape)
        strings: list[str] = []
        for r in range(max(rows, 1)):
            strings += top_k(arr[r * per_row:(r + 1) * per_row], k, labels.get(meta.name))
        shown = min(k, per_row)
        metas.append(TensorMeta(name=meta.name, dtype=BYTES, shape=[rows, shown] if rows else [shown]))
        out.append(pack([s.encode() for s in strings]))
    return msgspec.structs.replace(reply, outputs=metas), out


def answered(deps, reply: InferReply, frames: list, classes: dict[str, int]) -> tuple[InferReply, list]:
    """`classified` for the model or pipeline that answered (`deps`: the face's door port): its batch
    dim and label files as loaded (a pipeline has a batch dim and no labels)."""
    if not classes:
        return reply, frames
    if reply.model in deps.view.pipelines.table:
        return classified(reply, frames, classes, True, {})
    entry = deps.entry(reply.model)
    return classified(reply, frames, classes, entry.decl.batched, entry.labels)
