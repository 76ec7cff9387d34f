"""KServe v2 / Open Inference Protocol semantics both faces share: datatypes, one tensor's JSON
data both ways, the request parameters tgw reads or refuses, and the JSON-and-binary body.

Datatypes map to tgw dtypes one to one; `BYTES` is tgw's bytes (JSON strings, UTF-8; binary:
each element a 4-byte little-endian length and its bytes, tgw's own layout, so a binary BYTES
input goes to the ring as it came) and `BF16` is bfloat16 (JSON numbers, rounded to nearest
even; binary: 2 bytes an element). No ml_dtypes here: bfloat16 is handled as its bit patterns.

Parameters: priority, timeout (microseconds, as Triton's), routing_key and the sequence's
(streaming.py) are read; an output's `classification` asks for its top k (classification.py).
The gRPC face reads its typed parameters with the same functions. The checks clients match by
text are worded as Triton's server words them (its http_server.cc).

A body (the HTTP face's, as KServe's REST binding has it) is a JSON header, optionally followed
by raw tensor bytes: the binary tensor extension gives the header's length in
`Inference-Header-Content-Length` and each binary input's size in its
`parameters.binary_data_size`, in input order. Binary inputs become memoryview slices of the
body, so their bytes are copied once, into the ring, as native frames are. JSON `data` is parsed
by orjson and converted by numpy from the (flat or nested) list in one call. Outputs go back as
JSON (orjson writes numpy arrays itself) or as raw bytes after the JSON header. Datatypes,
tensors and parameters are one model (a body's tensors are read with the parameters beside them).

A raw body (is_raw: a PUT, or a POST whose Content-Type is no JSON's and that has no
Inference-Header-Content-Length; clients send JSON with no Content-Type, curl -d's form type or
text/plain, so those stay JSON) is the one element of a model's or pipeline's one BYTES input,
as TorchServe users send an image; its answer is the JSON one.

Everything wrong raises a TgwError naming the field; the face answers it in its own shape.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import orjson

from tgw.shm.bfloat16 import from_bfloat16_bits, to_bfloat16_bits
from tgw.shm.bytes_tensor import BytesTensorError, pack, unpack
from tgw.shm.errors import Code, fail
from tgw.shm.wire import BYTES, PROTOCOL_VERSION, Infer, InferReply, SequenceRef, TensorMeta

from tgw.broker.front.regions import SliceFrame   # a body's slice stands in for a ZeroMQ frame

from . import classification
from .errors import bad
from .streaming import sequence_ref

DATATYPES = {"BOOL": "bool", "INT8": "int8", "INT16": "int16", "INT32": "int32", "INT64": "int64",
             "UINT8": "uint8", "UINT16": "uint16", "UINT32": "uint32", "UINT64": "uint64",
             "FP16": "float16", "FP32": "float32", "FP64": "float64", "BF16": "bfloat16", "BYTES": BYTES}
DATATYPE_OF = {dtype: name for name, dtype in DATATYPES.items()}
BFLOAT16 = "bfloat16"
# the JSON element kinds numpy infers that each tensor kind takes: ints never take floats
TAKES = {"b": "b", "i": "iu", "u": "iu", "f": "iuf"}

HEADER_LENGTH = "Inference-Header-Content-Length"
ROUTING_HEADER = "tgw-routing-key"   # the routing key as a header (gRPC: metadata), for balancers to hash on too
# request parameters tgw has no meaning for: refused rather than silently ignored (none now)
UNOFFERED: dict[str, str] = {}
SHM_REGION = "shared_memory_region"   # Triton's client shared memory: only with a registry (triton_shm.py)


# ---- datatypes and one tensor's JSON data ------------------------------------------------

def datatype(value: Any, name: str) -> str:
    dtype = DATATYPES.get(value) if isinstance(value, str) else None
    if dtype is None:
        raise bad(f"input {name!r}: datatype {value!r} must be one of {', '.join(DATATYPES)}",
                  Code.INVALID_INPUT_DTYPE, input=name, got=value)
    return dtype


def json_tensor(data: Any, dtype: str, shape: list[int], name: str) -> memoryview:
    """The raw bytes of a JSON tensor: flat or nested lists of numbers (true/false for BOOL,
    strings for BYTES)."""
    if not isinstance(data, list):
        raise bad(f"input {name!r}: \"data\" must be a list", input=name)
    if dtype == BYTES:
        return json_bytes(data, shape, name)
    want = math.prod(shape)
    try:
        found = np.asarray(data)
    except ValueError as exc:   # ragged nesting
        raise bad(f"input {name!r}: \"data\" is not a regular array: {exc}", Code.INVALID_INPUT_SHAPE,
                  input=name) from None
    if found.size != want:
        raise bad(_count_words(found.size, want), Code.INVALID_INPUT_SHAPE, input=name, got=found.size, expected=want)
    target = np.dtype("float32" if dtype == BFLOAT16 else dtype)   # bfloat16: rounded from float32
    if want and found.dtype.kind not in TAKES[target.kind]:
        raise bad(f"input {name!r}: {DATATYPE_OF[dtype]} data must be "
                  f"{'true/false' if target.kind == 'b' else 'integers' if target.kind in 'iu' else 'numbers'}, "
                  f"got {kinds(found.dtype.kind)}", Code.INVALID_INPUT_DTYPE, input=name)
    try:
        with np.errstate(over="ignore"):   # past a float type's range is infinity, as a cast has it
            arr = found.astype(target, copy=False)
    except OverflowError as exc:
        raise bad(f"input {name!r}: {exc}", input=name) from None
    if target.kind in "iu" and want and not np.array_equal(arr, found):
        raise bad(f"input {name!r}: values out of the range of {DATATYPE_OF[dtype]}", input=name)
    if dtype == BFLOAT16:
        arr = to_bfloat16_bits(arr)
    return memoryview(np.ascontiguousarray(arr).reshape(-1)).cast("B")


def json_bytes(data: list, shape: list[int], name: str) -> memoryview:
    """A BYTES tensor's JSON strings (flat or nested, row-major) in tgw's bytes layout, UTF-8."""
    items: list = []
    _strings(data, items, name)
    want = math.prod(shape)
    if len(items) != want:
        raise bad(_count_words(len(items), want), Code.INVALID_INPUT_SHAPE, input=name, got=len(items), expected=want)
    return memoryview(pack(items))


def _count_words(got: int, want: int) -> str:
    """Triton's words for JSON `data` that does not hold the shape's elements (more, or fewer)."""
    if got > want:
        return "Unable to parse 'data': Shape does not match true shape of 'data' field"
    return "Failed to parse 'data' field: shape does not match true shape"


def _strings(data: list, out: list, name: str) -> None:
    for item in data:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, list):
            _strings(item, out, name)
        else:
            raise bad(f"input {name!r}: BYTES data must be strings (UTF-8 text; send other bytes with the binary "
                      f"extension), got {type(item).__name__}", Code.INVALID_INPUT_DTYPE, input=name)


def kinds(kind: str) -> str:
    return {"b": "booleans", "i": "integers", "u": "integers", "f": "floats"}.get(kind, "strings or objects")


def json_data(name: str, dtype: str, shape: list[int], frame) -> Any:
    """A reply's output as JSON `data`: a numpy array (orjson writes it), or a list of strings
    for BYTES; refused when an element is no UTF-8 text (the binary extension carries it)."""
    if dtype == BFLOAT16:   # as float64: its shortest repr is the bfloat16's exact value
        return from_bfloat16_bits(np.frombuffer(frame, dtype="<u2")).astype(np.float64)
    if dtype != BYTES:
        return np.frombuffer(frame, dtype=dtype)
    try:
        items = unpack(frame, math.prod(shape))
    except BytesTensorError as exc:   # the broker's own slice of a stage's output: a bug
        raise fail(Code.INTERNAL, f"output {name!r} is not a well-formed bytes tensor: {exc}", output=name) from None
    try:
        return [item.decode("utf-8") for item in items]
    except UnicodeDecodeError as exc:
        raise bad(f"output {name!r} holds bytes that are not UTF-8 text ({exc.reason} at byte {exc.start} of an "
                  "element), which JSON cannot carry: ask for it in binary (the output's parameters.binary_data: "
                  "true, or the request's binary_data_output: true)", output=name, reason="bytes_not_utf8") from None


# ---- request parameters ------------------------------------------------------------------

def refuse_unoffered(params: dict, where: str, shm_allowed: bool = False, **details) -> None:
    """A parameter tgw has no meaning for is refused by name, never silently ignored; so is a
    shared memory region where the face does not allow client shared memory."""
    for key, what in UNOFFERED.items():
        if key in params:
            raise bad(f"{where}parameter {key!r}: tgw does not offer {what}", parameter=key, **details)
    if SHM_REGION in params and not shm_allowed:
        raise bad(f"{where}parameter {SHM_REGION!r}: client shared-memory regions are off on this face "
                  "(set http.allow_client_shm: true; docs/SHARED_MEMORY.md)", parameter=SHM_REGION,
                  reason="client_shm_disabled", **details)


def mapping(value: Any, what: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad(f"{what} must be an object")
    return value


def int_param(params: dict, key: str, default: int) -> int:
    value = params.get(key, default)
    if type(value) is not int or value < 0:
        raise bad(f"parameter {key} must be a non-negative integer, got {value!r}", parameter=key)
    return value


def str_param(params: dict, key: str) -> str | None:
    value = params.get(key)
    if value is not None and not isinstance(value, str):
        raise bad(f"parameter {key} must be a string, got {value!r}", parameter=key)
    return value


def routing_key(param: str | None, given: str | None, where: str) -> str | None:
    """The request's routing key: parameter routing_key, or the tgw-routing-key header or metadata
    (`given`, named by `where`; empty counts as absent), or both when they agree - a balancer that
    hashes on the header and the canary split then see the same key."""
    if not given:
        return param
    if param is not None and param != given:
        raise bad(f"parameter routing_key {param!r} and {where} {given!r} differ: send one of them, or the "
                  "same key in both", parameter="routing_key")
    return given


def timeout_ms(params: dict) -> int | None:
    """`timeout` is in microseconds, as Triton's; tgw deadlines are whole milliseconds (at least 1)."""
    if "timeout" not in params:
        return None
    us = int_param(params, "timeout", 0)
    if us == 0:
        raise bad("parameter timeout must be positive (microseconds)", parameter="timeout")
    return max(1, -(-us // 1000))


# ---- the body: a JSON header and binary tensors ----------------------------------------------

class Decoded(NamedTuple):
    infer: Infer
    frames: list[SliceFrame]
    request_id: str | None          # the body's "id", echoed in the reply
    binary: frozenset[str] | bool   # outputs to send as raw bytes (True: all of them)
    places: dict = {}               # outputs to write into shared memory regions: name -> triton_shm.Place
    classes: dict = {}              # outputs asked for as their top k classes: name -> k (classification.py)


def header_length(value: str | None, body_size: int) -> int:
    """The JSON header's size: the whole body without the binary extension."""
    if value is None:
        return body_size
    try:
        n = int(value)
    except ValueError:
        raise bad(f"{HEADER_LENGTH} must be an integer, got {value!r}") from None
    if not 0 < n <= body_size:
        raise bad(f"{HEADER_LENGTH} is {n} but the body holds {body_size} bytes")
    return n


class Header(NamedTuple):
    """What a request's JSON header says, apart from the tensors' bytes."""
    metas: list[TensorMeta]
    sizes: list[int] | None          # each input's binary_data_size, when every input is binary
    outputs: list[str] | None
    binary: frozenset[str] | bool
    request_id: str | None
    priority: int
    timeout_ms: int | None
    routing_key: str | None
    shm_outputs: dict | None = None  # outputs naming a shared memory region: name -> their parameters
    sequence: SequenceRef | None = None   # Triton's sequence_id/sequence_start/sequence_end
    classes: dict = {}               # outputs asked for as their top k classes: name -> k


HEADERS_MAX = 256           # binary-only headers remembered (a steady stream repeats one)
HEADER_MEMO_BYTES = 4096    # longer headers are not remembered
_headers: dict[bytes, Header] = {}


def decode(body: bytes, length: str | None, model: str, version: str | None, req_id: int, shm=None,
           routing_header: str | None = None) -> Decoded:
    """The Infer message and tensor frames of one request body. A header whose inputs are all
    binary is parsed once and remembered by its bytes: a stream of like requests pays a lookup.
    `shm`: the face's triton_shm.TritonShm when it allows client shared memory (else regions are
    refused); an output's region is looked up anew for every request, a remembered header's too.
    `routing_header`: the request's tgw-routing-key header (routing_key says how it merges)."""
    n = header_length(length, len(body))
    view = memoryview(body)
    key = bytes(view[:n]) if length is not None and n <= HEADER_MEMO_BYTES else None
    head = _headers.get(key) if key is not None else None
    if head is None:
        head, frames, end = parse_header(view, n, shm)
        if key is not None and head.sizes is not None:
            if len(_headers) >= HEADERS_MAX:
                _headers.clear()
            _headers[key] = head
    else:
        frames, end = [], n
        for size in head.sizes:
            frames.append(SliceFrame(view[end:end + size]))
            end += size
        if end > len(body):
            raise bad(f"the inputs' binary_data_size ({end - n} bytes in all) does not fit the {len(body) - n} bytes "
                      "after the JSON header")
    if end != len(body):
        raise bad(f"{len(body) - end} bytes follow the last binary input (binary_data_size of each input "
                  "must add up to the body after the JSON header)")
    msg = Infer(v=PROTOCOL_VERSION, id=req_id, model=model, version=version, inputs=head.metas, outputs=head.outputs,
                priority=head.priority, timeout_ms=head.timeout_ms,
                routing_key=routing_key(head.routing_key, routing_header, f"header {ROUTING_HEADER}"),
                sequence=head.sequence)
    places = {}
    if head.shm_outputs:
        if shm is None:
            refuse_unoffered(head.shm_outputs[next(iter(head.shm_outputs))], "")
        places = {name: shm.output_place(name, params) for name, params in head.shm_outputs.items()}
    return Decoded(msg, frames, head.request_id, head.binary, places, head.classes)


def parse_header(view: memoryview, n: int, shm=None) -> tuple[Header, list[SliceFrame], int]:
    """The header, the inputs' frames and where the last binary input ends."""
    try:
        doc = orjson.loads(view[:n])
    except orjson.JSONDecodeError as exc:
        raise bad(f"request body is not JSON: {exc} (a raw body - an image, a file - for a model whose one input is "
                  "BYTES goes with its own Content-Type, e.g. -H 'Content-Type: image/jpeg', or as a PUT: curl -T "
                  "FILE; docs/HTTP.md)") from None
    if not isinstance(doc, dict):
        raise bad("request body must be a JSON object with \"inputs\"")
    params = mapping(doc.get("parameters"), "parameters")
    refuse_unoffered(params, "")
    inputs = doc.get("inputs")
    if not isinstance(inputs, list):   # an empty one: the model's check names what is missing, as Triton's
        raise bad("\"inputs\" must be a list of tensors")
    metas, frames, sizes, end = [], [], [], n
    for i, spec in enumerate(inputs):
        meta, frame, size = input_tensor(spec, i, view, end, shm)
        metas.append(meta)
        frames.append(frame)
        sizes.append(size)
        end += size or 0
    outputs, binary, shm_outputs, classes = requested_outputs(doc.get("outputs"), params, shm is not None)
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise bad(f"\"id\" must be a string, got {type(request_id).__name__}")
    head = Header(metas, sizes if None not in sizes else None, outputs, binary, request_id,
                  int_param(params, "priority", 0), timeout_ms(params), str_param(params, "routing_key"),
                  shm_outputs, sequence_ref(params), classes)
    return head, frames, end


def input_tensor(spec: Any, i: int, body: memoryview, offset: int, shm=None) \
        -> tuple[TensorMeta, SliceFrame, int | None]:
    """An input's meta and bytes, and its binary_data_size (None: JSON data or a region's bytes)."""
    if not isinstance(spec, dict):
        raise bad(f"inputs[{i}] must be an object")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise bad(f"inputs[{i}] needs a \"name\" string")
    shape = spec.get("shape")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise bad(f"input {name!r}: \"shape\" must be a list of non-negative integers, got {shape!r}",
                  Code.INVALID_INPUT_SHAPE, input=name)
    dtype = datatype(spec.get("datatype"), name)
    params = mapping(spec.get("parameters"), f"input {name!r} parameters")
    refuse_unoffered(params, f"input {name!r}: ", shm is not None, input=name)
    one_content(spec, params, name)
    if SHM_REGION in params:
        meta = TensorMeta(name=name, dtype=dtype, shape=shape)
        return meta, shm.input_frame(meta, params), None
    if "binary_data_size" in params:
        size = params["binary_data_size"]
        if type(size) is not int or size < 0 or offset + size > body.nbytes:
            raise bad(f"input {name!r}: binary_data_size {size!r} does not fit the {body.nbytes - offset} bytes "
                      "left in the body", input=name)
        return TensorMeta(name=name, dtype=dtype, shape=shape), SliceFrame(body[offset:offset + size]), size
    data = json_tensor(spec["data"], dtype, shape, name)
    return TensorMeta(name=name, dtype=dtype, shape=shape), SliceFrame(data), None


def one_content(spec: dict, params: dict, name: str) -> None:
    """Exactly one of data, binary_data_size, shared_memory_region: Triton's check and words."""
    given = [key for key, present in (("data", "data" in spec), ("binary_data_size", "binary_data_size" in params),
                                      ("shared_memory_region", SHM_REGION in params)) if present]
    if len(given) != 1:
        said = " no field is set" if not given else " set" + "".join(f" '{key}'" for key in given)
        raise bad("Input must set only one of the following fields: 'data', 'binary_data_size' in 'parameters', "
                  f"'shared_memory_region' in 'parameters'. But{said}", input=name, reason="input_contents")


def requested_outputs(outputs: Any, params: dict, shm_allowed: bool = False) \
        -> tuple[list[str] | None, frozenset[str] | bool, dict | None, dict]:
    everything_binary = params.get("binary_data_output", False)
    if type(everything_binary) is not bool:
        raise bad("parameter binary_data_output must be true or false")
    if outputs is None:
        return None, everything_binary, None, {}
    if not isinstance(outputs, list):
        raise bad("\"outputs\" must be a list")
    names, binary, shm_outputs, classes = [], set(), {}, {}
    for i, spec in enumerate(outputs):
        name = spec.get("name") if isinstance(spec, dict) else None
        if not isinstance(name, str):
            raise bad(f"outputs[{i}] needs a \"name\" string")
        out_params = mapping(spec.get("parameters"), f"output {name!r} parameters")
        refuse_unoffered(out_params, f"output {name!r}: ", shm_allowed, output=name)
        if SHM_REGION in out_params:
            shm_outputs[name] = out_params
        k = classification.class_count(out_params, name, SHM_REGION in out_params)
        if k:
            classes[name] = k
        flag = out_params.get("binary_data", everything_binary)
        if type(flag) is not bool:
            raise bad(f"output {name!r}: binary_data must be true or false", output=name)
        names.append(name)
        if flag:
            binary.add(name)
    return names, frozenset(binary), shm_outputs or None, classes


def encode(reply: InferReply, frames: list, request_id: str | None, binary: frozenset[str] | bool,
           placed: dict | None = None) -> tuple[bytes, list]:
    """The JSON header of a reply and the raw outputs that follow it (none: a JSON-only reply).
    `placed`: outputs written into shared memory regions, by name: their parameters, no data."""
    outputs, blobs = [], []
    for meta, frame in zip(reply.outputs, frames):
        out: dict[str, Any] = {"name": meta.name, "datatype": DATATYPE_OF[meta.dtype], "shape": meta.shape}
        if placed and meta.name in placed:
            out["parameters"] = placed[meta.name]
        elif binary is True or (binary and meta.name in binary):
            out["parameters"] = {"binary_data_size": len(frame)}
            blobs.append(frame)
        else:
            out["data"] = json_data(meta.name, meta.dtype, meta.shape, frame)
        outputs.append(out)
    doc: dict[str, Any] = {"model_name": reply.model, "model_version": reply.version, "outputs": outputs}
    if request_id is not None:
        doc["id"] = request_id
    return orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY), blobs


# ---- a raw body: the one element of a model's one BYTES input ----------------------------------

JSON_MEDIA = ("application/json", "application/x-www-form-urlencoded", "text/plain")   # and any */*+json
MULTIPART = "multipart/form-data"


def media_type(content_type: str | None) -> str:
    return (content_type or "").split(";", 1)[0].strip().lower()


def is_raw(method: str, content_type: str | None, header_length: str | None) -> bool:
    """Whether an infer body is raw rather than KServe's JSON (with or without the binary
    extension): every PUT; a POST with a Content-Type that is not JSON's, nor one that clients
    send JSON as (curl -d's form type; text/plain, a browser's and aiohttp's for a string), and
    no Inference-Header-Content-Length. A POST without a Content-Type is JSON."""
    if method == "PUT":
        return True
    media = media_type(content_type)
    return header_length is None and bool(media) and media not in JSON_MEDIA and not media.endswith("+json")


def takes(inputs) -> str:
    return ", ".join(f"{t.name} {DATATYPE_OF[t.dtype]} {[-1, *t.shape]}" for t in inputs) or "no inputs"


def decode_raw(body: bytes, content_type: str | None, inputs, model: str, version: str | None, req_id: int,
               routing_header: str | None = None, batched: bool = True) -> Decoded:
    """The Infer message and frame of a raw body, for `model`, whose declared `inputs` (IOSpec)
    must be one BYTES input of one element a row; its outputs are answered in JSON. `batched`:
    False for a model without a batch dim (the element is sent with the declared shape alone)."""
    shown = f"Content-Type {content_type}" if content_type else "no Content-Type"
    if media_type(content_type) == MULTIPART:
        raise bad(f"a multipart form body (curl -F) is not taken: send the file itself, as the body "
                  f"(curl --data-binary @FILE -H 'Content-Type: image/jpeg' URL, or curl -T FILE URL)",
                  reason="raw_body")
    if len(inputs) != 1 or inputs[0].dtype != BYTES or any(d != 1 for d in inputs[0].shape):
        raise bad(f"{model!r} cannot take a raw body ({shown}): a raw body is one BYTES element, for a model or "
                  f"pipeline whose one input is BYTES of shape [-1]; {model!r} takes {takes(inputs)}. Send KServe JSON "
                  "(Content-Type: application/json) or the binary tensor extension (docs/HTTP.md)",
                  reason="raw_body", expected=takes(inputs))
    if not body:
        raise bad(f"the raw body is empty ({shown}): send the bytes of {model!r}'s input {inputs[0].name!r}",
                  reason="raw_body", input=inputs[0].name)
    spec = inputs[0]
    meta = TensorMeta(name=spec.name, dtype=BYTES, shape=[1, *spec.shape] if batched else list(spec.shape))
    msg = Infer(v=PROTOCOL_VERSION, id=req_id, model=model, version=version, inputs=[meta],
                routing_key=routing_key(None, routing_header, f"header {ROUTING_HEADER}"))
    return Decoded(msg, [SliceFrame(memoryview(pack([body])))], None, False)
