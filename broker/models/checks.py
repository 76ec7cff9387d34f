"""The checks of a request's header against its model: the version it may be served by, and
its tensors against the declared inputs.

Pure checks, no I/O: a request that passes them is known to match its model's declared inputs
exactly, so workers never see malformed tensors. The refusals clients match by text are worded
as Triton's core words them (its infer_request.cc); the details carry tgw's fields.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from tgw.shm.errors import Code, fail
from tgw.shm.wire import BYTES, COMPRESSIONS, WIRE_DTYPES, Infer, IOSpec, TensorMeta, nbytes_of

from tgw.broker.state.versions import VersionRecord, VersionState

from .entry import ModelEntry

# Triton's protocol names of the datatypes (protocol/kserve.py's, which this layer may not import)
DATATYPE_NAMES = {"bool": "BOOL", "int8": "INT8", "int16": "INT16", "int32": "INT32", "int64": "INT64",
                  "uint8": "UINT8", "uint16": "UINT16", "uint32": "UINT32", "uint64": "UINT64", "float16": "FP16",
                  "float32": "FP32", "float64": "FP64", "bfloat16": "BF16", BYTES: "BYTES"}
BATCH_NOTE = ("NOTE: Setting a non-zero max_batch_size in the model config requires a batch dimension to be prepended "
              "to each input shape. If you want to specify the full shape including the batch dim in your input dims "
              "config, try setting max_batch_size to zero. See the model configuration docs for more info on "
              "max_batch_size.")


def wire_nbytes(meta: TensorMeta) -> int:
    """The bytes of `meta`'s tensor as sent (before any compression): its declared dtype's, or
    2 per element at a reduced wire precision (sched/inbound.py widens them back)."""
    size = WIRE_DTYPES.get(meta.wire_dtype) if meta.wire_dtype is not None else None
    if size is None:
        return nbytes_of(meta.dtype, meta.shape)
    return size * math.prod(meta.shape)


@dataclass(slots=True)
class Shape:
    """What the shape checks learned about one request (the same for every version)."""
    order: list[int]        # order[k] = index in the request of declared input k
    rows: int
    shape_key: tuple        # non-batch dims of every input, for batching variable shapes
    outputs: list[str]


@dataclass(slots=True)
class Checked:
    """What validation learned about one request."""
    model: ModelEntry
    record: VersionRecord
    shape: Shape

    @property
    def version(self) -> str:
        return self.record.version

    @property
    def rows(self) -> int:
        return self.shape.rows

    @property
    def order(self) -> list[int]:
        return self.shape.order

    @property
    def shape_key(self) -> tuple:
        return self.shape.shape_key

    @property
    def outputs(self) -> list[str]:
        return self.shape.outputs


def route(model: ModelEntry, req: Infer) -> VersionRecord:
    """The version the request names, or the traffic split's pick; refused unless it may be
    served (ready, and loaded once since start unless it loads on demand)."""
    if req.version is None:
        version = model.traffic.pick(req.routing_key)
        if version is None:
            raise fail(Code.MODEL_NOT_READY, f"model {model.name!r} has no version loaded", model=model.name,
                       reason="no_version")
    else:
        version = req.version
    rec = model.records.get(version)
    if rec is None or rec.state is VersionState.DRAINING:
        why = " (it is being unloaded)" if rec is not None else ""
        raise fail(Code.VERSION_NOT_FOUND, f"model {req.model!r} has no version {version!r}{why}",
                   model=req.model, version=version, available=model.routable())
    if rec.shadow:
        raise fail(Code.INVALID_ARGUMENT, f"model {req.model!r} version {version!r} is a shadow: it answers nobody "
                   "(copies of the serving versions' requests are compared with their answers); name another "
                   "version or none", model=req.model, version=version, reason="shadow_version")
    if rec.state is VersionState.LOADING or not (rec.seen or rec.on_demand):
        raise fail(Code.MODEL_NOT_READY, f"model {req.model!r} version {version!r} is not loaded yet",
                   model=req.model, version=version)
    if req.timeout_ms is not None and req.timeout_ms < 0:  # the client refuses it too (one rule)
        raise fail(Code.INVALID_ARGUMENT, f"timeout_ms must be >= 0, got {req.timeout_ms}",
                   timeout_ms=req.timeout_ms)
    return rec


def check_shapes(model: ModelEntry, req: Infer, frame_sizes: list[int]) -> Shape:
    order, rows, shape_key = _check_inputs(model, req, frame_sizes)
    return Shape(order, rows, shape_key, _check_outputs(model, req.outputs))


def _check_inputs(model: ModelEntry, req: Infer, frame_sizes: list[int]):
    """Triton's checks in Triton's order and words (core's infer_request.cc): the input count,
    unknown names, the batch, the datatype, the shape, the byte size. A model without a batch dim
    (max_batch_size 0) takes the declared shape exactly and runs as one row inside tgw."""
    if len(frame_sizes) != len(req.inputs):
        raise fail(Code.INVALID_ARGUMENT, f"header lists {len(req.inputs)} tensors but "
                   f"{len(frame_sizes)} tensor frames followed it")
    name = model.name
    names = [t.name for t in req.inputs]
    expected = [t.name for t in model.inputs]
    if len(names) != len(expected) or any(n not in model.input_index for n in names) or len(set(names)) != len(names):
        unknown = [n for n in names if n not in model.input_index]
        if len(names) != len(expected) or not unknown:   # a count off, or a name twice
            raise fail(Code.INVALID_ARGUMENT, count_words(name, expected, names), expected=expected, got=names)
        raise fail(Code.INVALID_ARGUMENT, f"unexpected inference input '{unknown[0]}' for model '{name}'",
                   input=unknown[0], expected=expected)
    order = [names.index(n) for n in expected]
    batched = model.decl.batched
    # unbatched: one row inside tgw (the scheduler, the ring and the worker see [1, *dims])
    rows, shape_key = (None if batched else 1), []
    if batched:
        for k, decl in enumerate(model.inputs):
            shape = req.inputs[order[k]].shape
            if not shape:
                raise fail(Code.INVALID_INPUT_SHAPE, f"input '{decl.name}' has no shape but model requires batch "
                           f"dimension for '{name}'", input=decl.name)
            if rows is None:
                rows = shape[0]
            elif shape[0] != rows:
                raise fail(Code.INVALID_INPUT_SHAPE, f"input '{decl.name}' batch size does not match other inputs "
                           f"for '{name}'", input=decl.name)
        if not 1 <= rows <= model.decl.max_batch_size:
            raise fail(Code.INVALID_INPUT_SHAPE, f"inference request batch-size must be <= "
                       f"{model.decl.max_batch_size} for '{name}'", max_batch_size=model.decl.max_batch_size, got=rows)
    for k, decl in enumerate(model.inputs):
        meta = req.inputs[order[k]]
        if meta.dtype != decl.dtype:
            raise fail(Code.INVALID_INPUT_DTYPE, dtype_words(name, decl.name, meta.dtype, decl.dtype),
                       input=decl.name, expected=decl.dtype, got=meta.dtype)
        shape = meta.shape
        dims = shape[1:] if batched else shape
        if len(dims) != len(decl.shape) or not _dims_match(dims, decl.shape):
            full = [-1, *decl.shape] if batched else decl.shape
            raise fail(Code.INVALID_INPUT_SHAPE, f"unexpected shape for input '{decl.name}' for model '{name}'. "
                       f"Expected {_dims(full)}, got {_dims(shape)}. {BATCH_NOTE if batched else ''}",
                       input=decl.name, expected=full, got=shape)
        if meta.compression is not None and meta.compression not in COMPRESSIONS:
            raise fail(Code.INVALID_ARGUMENT, f"unknown compression {meta.compression!r} on "
                       f"{decl.name!r}; supported: {list(COMPRESSIONS)}")
        if meta.wire_dtype is not None:
            _check_wire_dtype(model, decl, meta.wire_dtype)
        # a bytes tensor's size is its frame's: its layout is checked per request (inbound.bytes_tensor)
        if meta.compression is None and decl.dtype != BYTES:
            want, got = wire_nbytes(meta), frame_sizes[order[k]]
            if got != want:
                raise fail(Code.INVALID_ARGUMENT, f"input byte size mismatch for input '{decl.name}' for model "
                           f"'{name}'. Expected {want}, got {got}", input=decl.name, expected=want, got=got)
        if model.variable:
            shape_key.append(tuple(dims))
    return order, rows, tuple(shape_key)


def _check_outputs(model: ModelEntry, wanted: list[str] | None) -> list[str]:
    if wanted is None:
        return [t.name for t in model.outputs]
    unknown = [n for n in wanted if n not in model.output_names]
    if unknown:
        raise fail(Code.INVALID_ARGUMENT, f"unexpected inference output '{unknown[0]}' for model '{model.name}'",
                   output=unknown[0], expected=sorted(model.output_names))
    if len(set(wanted)) != len(wanted):
        raise fail(Code.INVALID_ARGUMENT, f"requested outputs {wanted}; model {model.name!r} has "
                   f"{sorted(model.output_names)} (each at most once)")
    return list(wanted)


def _check_wire_dtype(model: ModelEntry, decl: IOSpec, wire_dtype: str) -> None:
    """A float32 input sent at a reduced precision: one tgw knows, that the model's config allows."""
    allowed = model.decl.wire_dtypes
    if wire_dtype not in WIRE_DTYPES:
        raise fail(Code.INVALID_INPUT_DTYPE, f"input {decl.name!r}: unknown wire_dtype {wire_dtype!r}; "
                   f"one of {list(WIRE_DTYPES)}", input=decl.name, wire_dtype=wire_dtype)
    if decl.dtype != "float32":
        raise fail(Code.INVALID_INPUT_DTYPE, f"input {decl.name!r} is {decl.dtype}: only float32 inputs may be "
                   f"sent at a reduced wire_dtype ({wire_dtype})", input=decl.name, wire_dtype=wire_dtype)
    if wire_dtype not in allowed:
        raise fail(Code.INVALID_INPUT_DTYPE, f"model {model.name!r} does not take input {decl.name!r} as "
                   f"{wire_dtype}: its config allows {list(allowed) or 'no reduced precision'} "
                   f"(models[].wire_dtypes)", input=decl.name, wire_dtype=wire_dtype, allowed=list(allowed),
                   config_key="models[].wire_dtypes")


def count_words(model: str, expected: list[str], names: list[str]) -> str:
    """Triton's words for inputs that are not the declared ones, one for one."""
    missing = [n for n in expected if n not in names]
    shown = _quoted(missing) if missing else "]"   # Triton's own rendering of none missing (an extra input)
    return (f"expected {len(expected)} inputs but got {len(names)} inputs for model '{model}'. Got input(s) "
            f"{_quoted(names)}, but missing required input(s) {shown}. Please provide all required input(s).")


def dtype_words(model: str, name: str, got: str, expected: str) -> str:
    # a native client may send a dtype Triton has no name for: shown as sent
    return (f"inference input '{name}' data-type is '{DATATYPE_NAMES.get(got, got)}', but model '{model}' expects "
            f"'{DATATYPE_NAMES[expected]}'")


def _quoted(names: list[str]) -> str:
    return "[" + ",".join(f"'{n}'" for n in names) + "]"


def _dims(dims: list[int]) -> str:
    return "[" + ",".join(map(str, dims)) + "]"


def _dims_match(got: list[int], declared: list[int]) -> bool:
    return all(g >= 0 and (d == -1 or g == d) for g, d in zip(got, declared))
