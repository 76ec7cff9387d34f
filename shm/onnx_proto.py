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
The graph's inputs (initializers aside) and outputs are read with their element types and dims,
so a config that declares none (a Triton config.pbtxt left to auto-complete) can be filled in
without onnxruntime.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import IO, Optional

# ModelProto's fields: number -> (name, wire type); 0 varint, 2 length-delimited
MODEL_FIELDS = {1: ("ir_version", 0), 2: ("producer_name", 2), 3: ("producer_version", 2), 4: ("domain", 2),
                5: ("model_version", 0), 6: ("doc_string", 2), 7: ("graph", 2), 8: ("opset_import", 2),
                14: ("metadata_props", 2), 20: ("training_info", 2), 25: ("functions", 2), 26: ("configuration", 2)}
GRAPH_INITIALIZER, GRAPH_INPUT, GRAPH_OUTPUT = 5, 11, 12   # GraphProto: TensorProto, ValueInfoProto x2
TENSOR_DIMS, TENSOR_TYPE, TENSOR_NAME, TENSOR_EXTERNAL = 1, 2, 8, 13   # TensorProto's fields
VALUE_NAME, VALUE_TYPE = 1, 2         # ValueInfoProto.name, .type (TypeProto)
TYPE_TENSOR = 1                       # TypeProto.tensor_type (TypeProto.Tensor: elem_type 1, shape 2)
DIM_VALUE, DIM_PARAM = 1, 2           # TensorShapeProto.Dimension
# TensorProto.DataType -> tgw dtype
DTYPES = {1: "float32", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32", 7: "int64", 8: "bytes", 9: "bool",
          10: "float16", 11: "float64", 12: "uint32", 13: "uint64", 16: "bfloat16"}
ENTRY_KEY, ENTRY_VALUE = 1, 2         # StringStringEntryProto
# TensorProto.DataType -> bytes per element (strings and 4-bit types count as 0 and 1)
ITEM_BYTES = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 8: 0, 9: 1, 10: 2, 11: 8, 12: 4, 13: 8, 14: 8, 15: 16,
              16: 2, 17: 1, 18: 1, 19: 1, 20: 1, 21: 1, 22: 1, 23: 1, 24: 1, 25: 1, 26: 1}
MAX_VARINT_BYTES = 10


class NotOnnx(ValueError):
    """The file is not an ONNX ModelProto; the message says where it stops being one."""


@dataclass
class OnnxTensor:
    """A graph input or output: its name, tgw dtype (None: a type tgw does not serve, e.g. a
    sequence or complex64) and dims (-1: symbolic or unknown; None: rank unknown)."""
    name: str
    dtype: Optional[str]
    dims: Optional[list[int]]


@dataclass
class OnnxInfo:
    ir_version: int
    producer: str = ""
    initializer_bytes: int = 0        # the weights' bytes, inline and external
    external_files: list[str] = field(default_factory=list)   # external data locations, as written
    inputs: list[OnnxTensor] = field(default_factory=list)    # the graph's inputs, initializers aside
    outputs: list[OnnxTensor] = field(default_factory=list)


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
    inputs, weights = [], set()
    for number, wire, value in r.fields():
        if number == GRAPH_INITIALIZER and wire == 2:
            weights.add(_tensor(r.sub(value), info))
        elif number in (GRAPH_INPUT, GRAPH_OUTPUT) and wire == 2:
            (inputs if number == GRAPH_INPUT else info.outputs).append(_value_info(r.sub(value)))
        elif wire == 2:
            r.skip(value)
    # before IR version 4 every initializer was also listed as an input
    info.inputs = [t for t in inputs if t.name not in weights]


def _value_info(r: _Reader) -> OnnxTensor:
    name, dtype, dims = "", None, None
    for number, wire, value in r.fields():
        if number == VALUE_NAME and wire == 2:
            name = r.f.read(value).decode("utf-8", "replace")
        elif number == VALUE_TYPE and wire == 2:
            dtype, dims = _tensor_type(r.sub(value))
        elif wire == 2:
            r.skip(value)
    return OnnxTensor(name, dtype, dims)


def _tensor_type(r: _Reader) -> tuple[Optional[str], Optional[list[int]]]:
    dtype, dims = None, None
    for number, wire, value in r.fields():
        if number == TYPE_TENSOR and wire == 2:
            t = r.sub(value)
            for n2, w2, v2 in t.fields():
                if n2 == 1 and w2 == 0:
                    dtype = DTYPES.get(v2)
                elif n2 == 2 and w2 == 2:
                    dims = _shape(t.sub(v2))
                elif w2 == 2:
                    t.skip(v2)
        elif wire == 2:
            r.skip(value)   # a sequence, map or optional type: not a tensor tgw serves
    return dtype, dims


def _shape(r: _Reader) -> list[int]:
    dims = []
    for number, wire, value in r.fields():
        if number == 1 and wire == 2:   # a Dimension
            d, dim = r.sub(value), -1
            for n2, w2, v2 in d.fields():
                if n2 == DIM_VALUE and w2 == 0:
                    dim = v2
                elif w2 == 2:
                    d.skip(v2)
            dims.append(dim)
        elif wire == 2:
            r.skip(value)
    return dims


def _tensor(r: _Reader, info: OnnxInfo) -> str:
    dims, dtype, external, name = [], 0, {}, ""
    for number, wire, value in r.fields():
        if number == TENSOR_DIMS and wire == 0:
            dims.append(value)
        elif number == TENSOR_DIMS and wire == 2:   # packed
            packed = r.sub(value)
            while packed.pos() < packed.end:
                dims.append(packed.varint())
        elif number == TENSOR_TYPE and wire == 0:
            dtype = value
        elif number == TENSOR_NAME and wire == 2:
            name = r.f.read(value).decode("utf-8", "replace")
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
    return name


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
