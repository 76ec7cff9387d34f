"""The KServe v2 codec (broker/protocol/kserve.py) as a pure function: bodies in, Infer + frames out."""
from __future__ import annotations

import json

import numpy as np
import orjson
import pytest

from tgw.broker.protocol import kserve
from tgw.shm.errors import Code, TgwError
from tgw.shm.wire import InferReply, TensorMeta


def decode(doc: dict, blobs: bytes = b"", **kw):
    header = json.dumps(doc).encode()
    return kserve.decode(header + blobs, str(len(header)) if blobs else None, "m", kw.get("version"), 7)


def test_json_tensors_flat_or_nested_become_raw_bytes():
    for data in ([1, 2, 3, 4, 5, 6], [[1, 2, 3], [4, 5, 6]]):
        d = decode({"inputs": [{"name": "x", "shape": [2, 3], "datatype": "FP32", "data": data}]})
        (meta,), (frame,) = d.infer.inputs, d.frames
        assert (meta.name, meta.dtype, meta.shape) == ("x", "float32", [2, 3])
        assert len(frame) == 24 and np.frombuffer(frame.buffer, np.float32).tolist() == [1, 2, 3, 4, 5, 6]


def test_binary_inputs_are_views_of_the_body_not_copies():
    x, y = np.arange(4, dtype=np.int32), np.array([True, False])
    doc = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "INT32", "parameters": {"binary_data_size": 16}},
                      {"name": "y", "shape": [1, 2], "datatype": "BOOL", "parameters": {"binary_data_size": 2}}]}
    header = json.dumps(doc).encode()
    body = header + x.tobytes() + y.tobytes()
    d = kserve.decode(body, str(len(header)), "m", "3", 1)
    assert d.infer.version == "3" and [m.dtype for m in d.infer.inputs] == ["int32", "bool"]
    assert all(f.buffer.obj is body for f in d.frames)   # slices of the request body
    assert np.frombuffer(d.frames[0].buffer, np.int32).tolist() == [0, 1, 2, 3]


def test_parameters_map_to_the_native_fields():
    d = decode({"id": "abc", "inputs": [{"name": "x", "shape": [1], "datatype": "INT64", "data": [1]}],
                "parameters": {"priority": 1, "timeout": 1500, "routing_key": "user-9", "binary_data_output": True}})
    m = d.infer
    assert (m.priority, m.timeout_ms, m.routing_key, d.request_id, d.binary) == (1, 2, "user-9", "abc", True)
    d = decode({"inputs": [{"name": "x", "shape": [1], "datatype": "INT64", "data": [1]}],
                "outputs": [{"name": "a"}, {"name": "b", "parameters": {"binary_data": True}}]})
    assert d.infer.outputs == ["a", "b"] and d.binary == frozenset({"b"}) and d.infer.timeout_ms is None


@pytest.mark.parametrize("doc,code,words", [
    ({"inputs": [{"name": "x", "shape": [2], "datatype": "INT8", "data": [1, -200]}]}, Code.INVALID_ARGUMENT,
     "out of the range"),
    ({"inputs": [{"name": "x", "shape": [2], "datatype": "UINT16", "data": [1, -1]}]}, Code.INVALID_ARGUMENT,
     "out of the range"),
    ({"inputs": [{"name": "x", "shape": [1], "datatype": "BOOL", "data": [1]}]}, Code.INVALID_INPUT_DTYPE,
     "true/false"),
    ({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": ["1"]}]}, Code.INVALID_INPUT_DTYPE,
     "strings"),
    ({"inputs": [{"name": "x", "shape": [2, 2], "datatype": "FP32", "data": [[1, 2], [3]]}]},
     Code.INVALID_INPUT_SHAPE, "not a regular array"),
    ({"inputs": [{"name": "x", "shape": [-1], "datatype": "FP32", "data": [1]}]}, Code.INVALID_INPUT_SHAPE,
     "non-negative"),
    ({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32"}]}, Code.INVALID_ARGUMENT, "But no field is set"),
    ({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1], "parameters": {"binary_data_size": 4}}]},
     Code.INVALID_ARGUMENT, "But set 'data' 'binary_data_size'"),
    ({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "parameters": {"binary_data_size": None}}]},
     Code.INVALID_ARGUMENT, "binary_data_size None"),
    ({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}], "parameters": {"timeout": 0}},
     Code.INVALID_ARGUMENT, "timeout must be positive"),
    ({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}], "parameters": {"priority": -1}},
     Code.INVALID_ARGUMENT, "priority"),
    ({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}], "id": 5}, Code.INVALID_ARGUMENT,
     "\"id\" must be a string"),
    ({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1],
                  "parameters": {"shared_memory_region": "r"}}]}, Code.INVALID_ARGUMENT, "shared-memory"),
    ({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}],
      "outputs": [{"name": "y", "parameters": {"binary_data": "yes"}}]}, Code.INVALID_ARGUMENT, "true or false"),
    ({"inputs": "x"}, Code.INVALID_ARGUMENT, "must be a list of tensors"),
])
def test_every_bad_field_is_named(doc, code, words):
    with pytest.raises(TgwError) as info:
        decode(doc)
    assert info.value.code is code and words in info.value.message, info.value.message


def test_reply_json_and_binary():
    y, n = np.array([[1.5, -2.0]], np.float32), np.array([7], np.int64)
    reply = InferReply(v=1, id=1, model="m", version="2", outputs=[
        TensorMeta(name="y", dtype="float32", shape=[1, 2]), TensorMeta(name="n", dtype="int64", shape=[1])])
    header, blobs = kserve.encode(reply, [y.tobytes(), n.tobytes()], "abc", frozenset({"n"}))
    doc = orjson.loads(header)
    assert doc["id"] == "abc" and doc["model_version"] == "2"
    assert doc["outputs"][0] == {"name": "y", "datatype": "FP32", "shape": [1, 2], "data": [1.5, -2.0]}
    assert doc["outputs"][1] == {"name": "n", "datatype": "INT64", "shape": [1], "parameters": {"binary_data_size": 8}}
    assert blobs == [n.tobytes()]
    header, blobs = kserve.encode(reply, [y.tobytes(), n.tobytes()], None, False)
    assert blobs == [] and "id" not in orjson.loads(header)


def test_a_binary_header_is_parsed_once_and_the_body_still_checked_each_time():
    doc = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "parameters": {"binary_data_size": 8}}],
           "parameters": {"priority": 1}}
    header = json.dumps(doc).encode()
    kserve._headers.clear()
    first = kserve.decode(header + bytes(8), str(len(header)), "m", None, 1)
    assert list(kserve._headers) == [header]
    second = kserve.decode(header + np.array([1.5, 2.5], np.float32).tobytes(), str(len(header)), "m", "2", 2)
    assert (second.infer.id, second.infer.version, second.infer.priority) == (2, "2", 1)
    assert second.infer.inputs == first.infer.inputs
    assert np.frombuffer(second.frames[0].buffer, np.float32).tolist() == [1.5, 2.5]
    for body, words in ((header + bytes(4), "does not fit"), (header + bytes(9), "1 bytes follow")):
        with pytest.raises(TgwError, match=words):
            kserve.decode(body, str(len(header)), "m", None, 3)
