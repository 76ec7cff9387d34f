"""Triton's generate extension, its JSON both ways (pure): a flat request object as an Infer and
its frames, and an answer's outputs as the flat response object.

A request is one JSON object. A key that names one of the model's inputs is that input: a scalar
or a (nested) list, shaped by the value against the declared shape (a scalar fills a declared
[] or [1] or [-1]; a flat list fills a fixed shape of the same size), with the batch dim 1
added. `parameters` (an object) holds parameters, and every other key is a parameter too, as
Triton passes the extra keys of a generate request on. The parameters read are the KServe ones
(priority, timeout, routing_key, sequence_id/sequence_start/sequence_end) and, for a generator,
the generation's (max_tokens or max_outputs, temperature, top_k, top_p, seed, stop_tokens);
`stream` is taken and ignored (the endpoint decides); any other is refused by name, never
silently dropped.

A response is {"model_name", "model_version", <output>: value, ...}: an output of one element as
a scalar, else a flat list of its elements, BYTES as strings, as Triton writes it. A generator's
/generate answer holds each output as the list of its values at every position.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from tgw.shm.errors import Code
from tgw.shm.wire import BYTES, PROTOCOL_VERSION, Infer, TensorMeta

from tgw.broker.front.regions import SliceFrame
from tgw.broker.protocol import kserve
from tgw.broker.protocol.errors import bad
from tgw.broker.protocol.streaming import GENERATE_KEYS, SEQUENCE_KEYS, generate_params, sequence_ref

KSERVE_KEYS = ("priority", "timeout", "routing_key")
IGNORED_KEYS = ("stream",)   # Triton's examples send it; the endpoint says whether to stream


def request(doc: Any, inputs: list, model: str, version: str | None, req_id: int, generator: bool,
            routing_header: str | None = None) -> tuple[Infer, list[SliceFrame]]:
    """The Infer (a generation when `generator`) and input frames of a generate request `doc`
    (the parsed body) for a model whose declared inputs (IOSpec, no batch dim) are `inputs`."""
    if not isinstance(doc, dict):
        raise bad("a generate request is a JSON object: {\"<input>\": value, ..., \"parameters\": {...}}")
    params = dict(kserve.mapping(doc.get("parameters"), "parameters"))
    declared = {t.name: t for t in inputs}
    for key, value in doc.items():
        if key == "parameters" or key in declared:
            continue
        if key in params and params[key] != value:
            raise bad(f"parameter {key!r} is given twice, as a key and in \"parameters\", with different values",
                      parameter=key)
        params[key] = value
    check_parameters(params, generator)
    missing = [name for name in declared if name not in doc]
    if missing:
        raise bad(f"model {model!r} needs input(s) {', '.join(map(repr, missing))} as key(s) of the request "
                  f"(it takes {kserve.takes(inputs)})", input=missing[0])
    metas, frames = [], []
    for spec in inputs:
        meta, frame = tensor(doc[spec.name], spec)
        metas.append(meta)
        frames.append(frame)
    for key in IGNORED_KEYS:
        if key in params and type(params[key]) is not bool:
            raise bad(f"parameter {key} must be a boolean, got {params[key]!r}", parameter=key)
    msg = Infer(v=PROTOCOL_VERSION, id=req_id, model=model, version=version, inputs=metas,
                priority=kserve.int_param(params, "priority", 0), timeout_ms=kserve.timeout_ms(params),
                routing_key=kserve.routing_key(kserve.str_param(params, "routing_key"), routing_header,
                                               f"header {kserve.ROUTING_HEADER}"),
                sequence=sequence_ref(params), generate=generate_params(params) if generator else None)
    return msg, frames


def check_parameters(params: dict, generator: bool) -> None:
    """Every parameter is one tgw reads for this model: a typo is refused, not ignored."""
    kserve.refuse_unoffered(params, "")
    known = (*KSERVE_KEYS, *SEQUENCE_KEYS, *IGNORED_KEYS, *(GENERATE_KEYS if generator else ()))
    for key in params:
        if key in known:
            continue
        if key in GENERATE_KEYS:
            raise bad(f"parameter {key!r} is a generation's, and this model is not a generator", parameter=key,
                      reason="not_a_generator")
        raise bad(f"{key!r} is neither an input of the model nor a parameter tgw reads ({', '.join(known)})",
                  parameter=key)


def shape_of(value: Any, spec, name: str) -> list[int]:
    """The value's shape against the declared one (no batch dim): its own nesting when that fits,
    else the declared shape when it is fixed and holds as many elements."""
    found = list(np.shape(value))
    declared = list(spec.shape)
    if len(found) == len(declared) and all(d in (-1, f) for d, f in zip(declared, found)):
        return found
    count = math.prod(found)
    if -1 not in declared and math.prod(declared) == count:
        return declared
    if declared == [-1] and not found:   # a scalar for a list of any length
        return [1]
    raise bad(f"input {name!r}: a value of shape {found} does not fit the declared shape {declared}",
              Code.INVALID_INPUT_SHAPE, input=name, got=found, expected=declared)


def tensor(value: Any, spec) -> tuple[TensorMeta, SliceFrame]:
    """One input's meta (batch dim 1) and bytes from its JSON value."""
    name = spec.name
    if isinstance(value, dict) or value is None:
        raise bad(f"input {name!r}: a value is a scalar or a list, got {type(value).__name__}", input=name)
    try:
        shape = shape_of(value, spec, name)
    except ValueError as exc:   # ragged nesting
        raise bad(f"input {name!r} is not a regular array: {exc}", Code.INVALID_INPUT_SHAPE, input=name) from None
    data = value if isinstance(value, list) else [value]
    return TensorMeta(name=name, dtype=spec.dtype, shape=[1, *shape]), \
        SliceFrame(kserve.json_tensor(data, spec.dtype, shape, name))


# ---- responses -----------------------------------------------------------------------------

def value(arr: np.ndarray) -> Any:
    """An output as Triton's generate writes it: one element a scalar, else a flat list."""
    flat = arr.reshape(-1)
    return flat[0].item() if flat.size == 1 else flat.tolist()


def head(model: str, version: str) -> dict:
    return {"model_name": model, "model_version": version}


def events(model: str, version: str, arrays: dict[str, np.ndarray]) -> list[dict]:
    """One response object per position of a GenerateOutputs' arrays ([count, *shape] each)."""
    count = len(next(iter(arrays.values()))) if arrays else 0
    return [{**head(model, version), **{name: value(a[i]) for name, a in arrays.items()}} for i in range(count)]


def collected(model: str, version: str, chunks: list[dict[str, np.ndarray]], names: list[str]) -> dict:
    """A generator's /generate answer: each output as the list of its values at every position."""
    doc = head(model, version)
    for name in names:
        doc[name] = [value(row) for chunk in chunks for row in chunk[name]]
    return doc


def one_shot(reply, frames: list) -> dict:
    """A plain model's reply (batch dim 1) as a generate response object."""
    doc = head(reply.model, reply.version)
    for meta, frame in zip(reply.outputs, frames):
        data = kserve.json_data(meta.name, meta.dtype, meta.shape, frame)
        if meta.dtype == BYTES:
            doc[meta.name] = data[0] if len(data) == 1 else data
        else:
            doc[meta.name] = value(np.asarray(data))
    return doc
