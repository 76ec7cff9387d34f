"""KServe v2 tensors over gRPC: a ModelInferRequest in (Infer message and frames), a reply out.

Inputs come as `raw_input_contents` (one entry per input not read from shared memory, in input
order: the bytes go to the ring as they came) or typed `contents` (converted by numpy in one
call; BYTES from bytes_contents, packed in tgw's 4-byte-length layout, which is Triton's raw
layout too; FP16 and BF16 have no typed field, so they come raw only). Outputs go back as
`raw_output_contents`, or into a client shared-memory region when an output names one.

Request parameters are read as over HTTP (protocol/kserve.py): priority, timeout (microseconds),
routing_key and the sequence's (sequence_id, sequence_start, sequence_end); a generation's limits
and sampling (max_tokens, temperature, ...: protocol/streaming.py) when the model is a generator;
an output's `classification` (tritonclient's class_count) asks for its top k (protocol/
classification.py); others are ignored. The checks clients match by text use Triton's words.
Everything wrong raises a TgwError naming the field.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from tgw.shm.bytes_tensor import pack
from tgw.shm.errors import Code
from tgw.shm.wire import BYTES, PROTOCOL_VERSION, Infer, InferReply, TensorMeta

from tgw.broker.front.regions import SliceFrame
from tgw.broker.protocol import classification, kserve
from tgw.broker.protocol.errors import bad
from tgw.broker.protocol.kserve import DATATYPE_OF, SHM_REGION, datatype
from tgw.broker.protocol.streaming import generate_params, sequence_ref

from .proto import grpc_service_pb2 as pb

# each tgw dtype's typed contents field (FP16, BF16: none, raw only)
TYPED = {"bool": "bool_contents", "int8": "int_contents", "int16": "int_contents", "int32": "int_contents",
         "int64": "int64_contents", "uint8": "uint_contents", "uint16": "uint_contents", "uint32": "uint_contents",
         "uint64": "uint64_contents", "float32": "fp32_contents", "float64": "fp64_contents", BYTES: "bytes_contents"}


class Decoded(NamedTuple):
    infer: Infer
    frames: list
    request_id: str                   # the request's `id`, echoed in the reply
    places: dict[str, Any]            # output name -> its shared-memory place (deps.shm.output_place)
    classes: dict = {}                # output name -> k: answered as its top k classes (class_count)


def parameters(params) -> dict:
    """A map<string, InferParameter> (or ModelRepositoryParameter) as plain values."""
    out = {}
    for key, p in params.items():
        which = p.WhichOneof("parameter_choice")
        if which is not None:
            out[key] = getattr(p, which)
    return out


def set_parameter(p, value) -> None:
    if isinstance(value, bool):
        p.bool_param = value
    elif isinstance(value, int):
        p.int64_param = value
    elif isinstance(value, float):
        p.double_param = value
    else:
        p.string_param = str(value)


def refuse_unoffered(params: dict, where: str, **details) -> None:
    """Refused by name as over HTTP; a shared-memory region is this face's own business (deps.shm)."""
    kserve.refuse_unoffered(params, where, shm_allowed=True, **details)


def decode(req: pb.ModelInferRequest, req_id: int, version: str | None, shm=None,
           deadline_ms: int | None = None, generate: bool = False) -> Decoded:
    """The Infer message and frames of one request; `deadline_ms`: the call's gRPC deadline
    (the smaller of it and a `timeout` parameter wins); `shm`: the shared-memory registry
    (None: regions refused); `generate`: the request is a generation (its model a generator)."""
    params = parameters(req.parameters)
    refuse_unoffered(params, "")
    raw = req.raw_input_contents
    metas, frames, next_raw = [], [], 0
    for i, spec in enumerate(req.inputs):
        meta, tparams = input_meta(spec, i)
        frame = region_frame(shm, meta, tparams, "input")
        if frame is None:
            if raw:
                if next_raw >= len(raw):
                    raise bad(f"{len(raw)} raw_input_contents for more inputs than that: give one per input "
                              "(not read from shared memory), in input order", input=meta.name)
                if spec.HasField("contents"):   # Triton's words (its grpc/infer_handler.cc)
                    raise bad(f"contents field must not be specified when using raw_input_contents for "
                              f"'{meta.name}' for model '{req.model_name}'", input=meta.name)
                frame = SliceFrame(memoryview(raw[next_raw]))
                next_raw += 1
            else:
                frame = SliceFrame(typed(spec, meta, req.model_name))
        metas.append(meta)
        frames.append(frame)
    if next_raw != len(raw):
        raise bad(f"{len(raw)} raw_input_contents for {next_raw} inputs that take them: give one per input "
                  "(not read from shared memory), in input order")
    outputs, places, classes = requested_outputs(req.outputs, shm)
    timeout = kserve.timeout_ms(params)
    if deadline_ms is not None:
        timeout = deadline_ms if timeout is None else min(timeout, deadline_ms)
    msg = Infer(v=PROTOCOL_VERSION, id=req_id, model=req.model_name, version=version, inputs=metas, outputs=outputs,
                priority=kserve.int_param(params, "priority", 0), timeout_ms=timeout,
                routing_key=kserve.str_param(params, "routing_key"), sequence=sequence_ref(params),
                generate=generate_params(params) if generate else None)
    return Decoded(msg, frames, req.id, places, classes)


def input_meta(spec, i: int) -> tuple[TensorMeta, dict]:
    name = spec.name
    if not name:
        raise bad(f"inputs[{i}] needs a name")
    shape = list(spec.shape)
    if any(d < 0 for d in shape):
        raise bad(f"input {name!r}: shape must be non-negative integers, got {shape}", Code.INVALID_INPUT_SHAPE,
                  input=name)
    tparams = parameters(spec.parameters)
    refuse_unoffered(tparams, f"input {name!r}: ", input=name)
    return TensorMeta(name=name, dtype=datatype(spec.datatype, name), shape=shape), tparams


def region_frame(shm, meta: TensorMeta, params: dict, kind: str):
    """The frame of an input read from a registered region (None: it names none)."""
    if SHM_REGION not in params:
        return None
    if shm is None:
        raise bad(f"{kind} {meta.name!r} names shared-memory region {params[SHM_REGION]!r}, but client shared "
                  "memory is off on this face (grpc.allow_client_shm)", parameter=SHM_REGION)
    return shm.input_frame(meta, params)


def typed(spec, meta: TensorMeta, model: str = "") -> memoryview:
    """An input's typed contents as the bytes the ring takes."""
    name, dtype = meta.name, meta.dtype
    field = TYPED.get(dtype)
    if field is None:
        raise bad(f"input {name!r}: {DATATYPE_OF[dtype]} has no typed contents field in the protocol: send it in "
                  "raw_input_contents", Code.INVALID_INPUT_DTYPE, input=name)
    values = getattr(spec.contents, field)
    want = math.prod(meta.shape)
    if len(values) != want:   # Triton's core words: its bytes (a string tensor: its elements)
        other = [f for f in set(TYPED.values()) if f != field and len(getattr(spec.contents, f))]
        if not values and not other:
            raise bad(f"unable to find data for input tensor '{name}' for model '{model}' in request.", input=name)
        if dtype == BYTES:
            raise bad(f"expected {want} string elements for inference input '{name}' for model '{model}', got "
                      f"{len(values)}", Code.INVALID_INPUT_SHAPE, input=name, got=len(values), expected=want)
        size = np.dtype(dtype).itemsize
        hint = f" (contents.{other[0]} is not {DATATYPE_OF[dtype]}'s field, {field})" if other else ""
        raise bad(f"input byte size mismatch for input '{name}' for model '{model}'. Expected {want * size}, got "
                  f"{len(values) * size}{hint}", Code.INVALID_INPUT_SHAPE, input=name, got=len(values), expected=want)
    if dtype == BYTES:
        return memoryview(pack(values))
    wide = np.array(values, dtype="float64" if field.startswith("fp") else "bool" if dtype == "bool"
                    else "uint64" if field.startswith("uint") else "int64")
    arr = wide.astype(dtype)
    if dtype not in ("float32", "float64", "bool") and not np.array_equal(arr, wide):
        raise bad(f"input {name!r}: values out of the range of {DATATYPE_OF[dtype]}", input=name)
    return memoryview(arr).cast("B")


def requested_outputs(specs, shm) -> tuple[list[str] | None, dict, dict]:
    if not specs:
        return None, {}, {}
    names, places, classes = [], {}, {}
    for i, spec in enumerate(specs):
        if not spec.name:
            raise bad(f"outputs[{i}] needs a name")
        oparams = parameters(spec.parameters)
        refuse_unoffered(oparams, f"output {spec.name!r}: ", output=spec.name)
        k = classification.class_count(oparams, spec.name, SHM_REGION in oparams)
        if k:
            classes[spec.name] = k
        if SHM_REGION in oparams:
            if shm is None:
                raise bad(f"output {spec.name!r} names shared-memory region {oparams[SHM_REGION]!r}, but client "
                          "shared memory is off on this face (grpc.allow_client_shm)", parameter=SHM_REGION)
            place = shm.output_place(spec.name, oparams)
            if place is not None:
                places[spec.name] = place
        names.append(spec.name)
    return names, places, classes


def encode(reply: InferReply, frames: list, decoded: Decoded, shm=None) -> pb.ModelInferResponse:
    """The reply as Triton sends it: every output's bytes raw, in output order (an output written to
    shared memory holds an empty entry, so the others keep their index)."""
    resp = pb.ModelInferResponse(model_name=reply.model, model_version=reply.version, id=decoded.request_id)
    for meta, frame in zip(reply.outputs, frames):
        out = resp.outputs.add(name=meta.name, datatype=DATATYPE_OF[meta.dtype], shape=meta.shape)
        place = decoded.places.get(meta.name)
        if place is not None:
            for key, value in shm.write_output(place, meta, frame).items():
                set_parameter(out.parameters[key], value)
            resp.raw_output_contents.append(b"")
        else:
            resp.raw_output_contents.append(frame)
    return resp
