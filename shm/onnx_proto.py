"""The few fields of an ONNX model file tgw reads without the onnx package or onnxruntime.

An ONNX file is one protobuf message, ModelProto (onnx/onnx.proto). Its top-level fields are
walked by their wire tags, skipping the large ones (the graph's nodes, raw weight bytes) with
a seek, so telling an ONNX file from anything else costs a few reads whatever its size: the
broker checks a config with it (check-config, start-up, reload, `models load`) without
onnxruntime, and the worker with it sizes a model's weights (its initializers) for the footprint.
Every top-level field must be one of ModelProto's with its wire type, and `ir_version` and
`graph` must be there; a torch.save checkpoint, a TorchScript zip or a text file fails at
once. Initializers stored outside the file (`torch.onnx.export` writes `model.onnx.data` beside
`model.onnx` by default) are named, so a missing or escaping data file is refused up front.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import IO

# ModelProto's fields: number -> (name, wire type); 0 varint, 2 length-delimited
MODEL_FIELDS = {1: ("ir_version", 0), 2: ("producer_name", 2), 3: ("producer_version", 2), 4: ("domain", 2),
                5: ("model_version", 0), 6: ("doc_string", 2), 7: ("graph", 2), 8: ("opset_import", 2),
                14: ("metadata_props", 2), 20: ("training_info", 2), 25: ("functions", 2), 26: ("configuration", 2)}
GRAPH_INITIALIZER = 5                 # GraphProto.initializer: repeated TensorProto
TENSOR_DIMS, TENSOR_TYPE, TENSOR_EXTERNAL = 1, 2, 13   # TensorProto.dims, data_type, external_data
ENTRY_KEY, ENTRY_VALUE = 1, 2         # StringStringEntryProto
# TensorProto.DataType -> bytes per element (strings and 4-bit types count as 0 and 1)
ITEM_BYTES = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 8: 0, 9: 1, 10: 2, 11: 8, 12: 4, 13: 8, 14: 8, 15: 16,
              16: 2, 17: 1, 18: 1, 19: 1, 20: 1, 21: 1, 22: 1, 23: 1, 24: 1, 25: 1, 26: 1}
MAX_VARINT_BYTES = 10


class NotOnnx(ValueError):
    """The file is not an ONNX ModelProto; the message says where it stops being one."""


@dataclass
class OnnxInfo:
    ir_version: int
    producer: str = ""
    initializer_bytes: int = 0        # the weights' bytes, inline and external
    external_files: list[str] = field(default_factory=list)   # external data locations, as written


class _Reader:
    """Protobuf wire reading over a seekable binary file, within [pos, end)."""

    def __init__(self, f: IO[bytes], end: int):
        self.f, self.end = f, end

    def pos(self) -> int:
        return self.f.tell()

    def varint(self) -> int:
        value = 0
        for i in range(MAX_VARINT_BYTES):
            b = self.f.read(1)
            if not b:
                raise NotOnnx("the file ends inside a field")
            value |= (b[0] & 0x7F) << (7 * i)
            if not b[0] & 0x80:
                return value
        raise NotOnnx("a varint runs past 10 bytes")

    def fields(self):
        """(number, wire type, length or value) of each field till `end`; a length-delimited
        field's bytes start at pos() and must be consumed or skipped by the caller."""
        while self.pos() < self.end:
            tag = self.varint()
            number, wire = tag >> 3, tag & 7
            if wire == 0:
                yield number, wire, self.varint()
            elif wire == 2:
                length = self.varint()
                if self.pos() + length > self.end:
                    raise NotOnnx(f"field {number} runs past the end of its message")
                yield number, wire, length
            elif wire in (1, 5):
                self.f.seek(8 if wire == 1 else 4, 1)
                yield number, wire, 0
            else:
                raise NotOnnx(f"wire type {wire} (field {number}) is none of protobuf's")

    def skip(self, length: int) -> None:
        self.f.seek(length, 1)

    def sub(self, length: int) -> "_Reader":
        return _Reader(self.f, self.pos() + length)


def read_model(f: IO[bytes]) -> OnnxInfo:
    """What tgw needs of the ONNX file `f` (seekable, read from its start); NotOnnx when it is
    no ModelProto."""
    size = f.seek(0, 2)
    f.seek(0)
    if size == 0:
        raise NotOnnx("the file is empty")
    r = _Reader(f, size)
    info, seen = OnnxInfo(ir_version=0), set()
    for number, wire, value in r.fields():
        known = MODEL_FIELDS.get(number)
        if known is None or known[1] != wire:
            at = "" if seen else " at its first byte"
            raise NotOnnx(f"field {number} (wire type {wire}){at} is not one of ONNX ModelProto's")
        seen.add(known[0])
        if known[0] == "ir_version":
            info.ir_version = value
        elif known[0] == "producer_name" and value < 256:
            info.producer = f.read(value).decode("utf-8", "replace")
        elif known[0] == "graph":
            _graph(r.sub(value), info)
        elif wire == 2:
            r.skip(value)
    missing = [n for n in ("ir_version", "graph") if n not in seen]
    if missing:
        raise NotOnnx(f"no {' and no '.join(missing)}, which every ONNX model has")
    return info


def _graph(r: _Reader, info: OnnxInfo) -> None:
    for number, wire, value in r.fields():
        if number == GRAPH_INITIALIZER and wire == 2:
            _tensor(r.sub(value), info)
        elif wire == 2:
            r.skip(value)


def _tensor(r: _Reader, info: OnnxInfo) -> None:
    dims, dtype, external = [], 0, {}
    for number, wire, value in r.fields():
        if number == TENSOR_DIMS and wire == 0:
            dims.append(value)
        elif number == TENSOR_DIMS and wire == 2:   # packed
            packed = r.sub(value)
            while packed.pos() < packed.end:
                dims.append(packed.varint())
        elif number == TENSOR_TYPE and wire == 0:
            dtype = value
        elif number == TENSOR_EXTERNAL and wire == 2:
            key, val = _entry(r.sub(value))
            external[key] = val
        elif wire == 2:
            r.skip(value)
    count = 1
    for d in dims:
        count *= d
    info.initializer_bytes += count * ITEM_BYTES.get(dtype, 0)
    location = external.get("location")
    if location is not None and location not in info.external_files:
        info.external_files.append(location)


def _entry(r: _Reader) -> tuple[str, str]:
    key = value = ""
    for number, wire, length in r.fields():
        if wire != 2:
            continue
        text = r.f.read(length).decode("utf-8", "replace")
        if number == ENTRY_KEY:
            key = text
        elif number == ENTRY_VALUE:
            value = text
    return key, value
