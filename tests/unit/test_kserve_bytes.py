"""KServe v2 BYTES and BF16 tensors (broker/protocol/kserve.py): JSON and binary
request data to the ring's bytes, replies back to JSON or binary; a binary BYTES input exactly as
tritonclient serialises it; hostile length prefixes refused by the broker's layout check."""
from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import orjson
import pytest
import torch
from tritonclient.utils import serialize_byte_tensor

from tgw.broker.config.schema import ServerDecl
from tgw.broker.sched.inbound import tensor_bytes
from tgw.broker.protocol import kserve
from tgw.shm.bytes_tensor import pack
from tgw.shm.errors import Code, TgwError
from tgw.shm.wire import InferReply, TensorMeta

SERVER = ServerDecl(max_request_bytes=1 << 20, max_element_bytes=64)


def decode(doc: dict, blobs: bytes = b""):
    header = json.dumps(doc).encode()
    return kserve.decode(header + blobs, str(len(header)) if blobs else None, "m", None, 7)


def only(d):
    (meta,), (frame,) = d.infer.inputs, d.frames
    return meta, frame


@pytest.mark.parametrize("data", [["a", "ü", ""], [["a"], ["ü"], [""]]])
def test_json_bytes_are_utf8_strings_flat_or_nested(data):
    meta, frame = only(decode({"inputs": [{"name": "s", "shape": [3, 1], "datatype": "BYTES", "data": data}]}))
    assert (meta.dtype, meta.shape) == ("bytes", [3, 1])
    assert bytes(frame.buffer) == pack([b"a", "ü".encode(), b""])


def test_binary_bytes_as_tritonclient_sends_them_go_to_the_ring_as_they_came():
    items = np.array([[b"\xff\x00jpeg", b""], [b"text", b"\x01" * 40]], dtype=object)
    raw = serialize_byte_tensor(items).item()
    assert raw == pack(items.ravel().tolist())   # tritonclient's layout is tgw's
    header = json.dumps({"inputs": [{"name": "img", "shape": [2, 2], "datatype": "BYTES",
                                     "parameters": {"binary_data_size": len(raw)}}]}).encode()
    body = header + raw
    meta, frame = only(kserve.decode(body, str(len(header)), "m", None, 1))
    assert frame.buffer.obj is body and bytes(frame.buffer) == raw             # no re-encoding, no copy
    assert bytes(tensor_bytes(meta, frame.buffer, SERVER)) == raw               # admission's check passes it


@pytest.mark.parametrize("raw, shape, code, words", [
    (b"\x03\x00\x00", [1], Code.INVALID_ARGUMENT, "inside its 4-byte length"),
    (b"\xff\xff\xff\x7fab", [1], Code.INVALID_ARGUMENT, "only 2 bytes follow"),
    (pack([b"a"]) + b"\x00", [1], Code.INVALID_ARGUMENT, "1 bytes follow the last"),
    (pack([b"a"]), [3], Code.INVALID_ARGUMENT, "element 1 of 3"),
    (pack([b"x" * 65]), [1], Code.PAYLOAD_TOO_LARGE, "server.max_element_bytes"),
])
def test_bad_length_prefixes_in_a_binary_body_are_refused(raw, shape, code, words):
    header = json.dumps({"inputs": [{"name": "img", "shape": shape, "datatype": "BYTES",
                                     "parameters": {"binary_data_size": len(raw)}}]}).encode()
    meta, frame = only(kserve.decode(header + raw, str(len(header)), "m", None, 1))
    with pytest.raises(TgwError) as info:
        tensor_bytes(meta, frame.buffer, SERVER)
    assert info.value.code is code and words in info.value.message and "'img'" in info.value.message


@pytest.mark.parametrize("data, code, words", [
    (["a", "b"], Code.INVALID_INPUT_SHAPE, "shape does not match true shape"),
    (["a", 1, "c"], Code.INVALID_INPUT_DTYPE, "must be strings"),
    ("abc", Code.INVALID_ARGUMENT, "must be a list"),
])
def test_bad_json_bytes_are_named(data, code, words):
    with pytest.raises(TgwError) as info:
        decode({"inputs": [{"name": "s", "shape": [3], "datatype": "BYTES", "data": data}]})
    assert info.value.code is code and words in info.value.message
    assert info.value.details["input"] == "s"   # Triton's words for a count do not name it: the details do


def test_json_bf16_numbers_round_to_nearest_even():
    values = [1.0, 1.00390625, 1.01171875, -3.0e38, 3.4e38, 65504.5, 0.1, 7]
    meta, frame = only(decode({"inputs": [{"name": "x", "shape": [2, 4], "datatype": "BF16", "data": values}]}))
    want = torch.tensor(values, dtype=torch.float32).to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    assert (meta.dtype, meta.shape, bytes(frame.buffer)) == ("bfloat16", [2, 4], want)
    with pytest.raises(TgwError) as info:
        decode({"inputs": [{"name": "x", "shape": [1], "datatype": "BF16", "data": [True]}]})
    assert info.value.code is Code.INVALID_INPUT_DTYPE and "BF16 data must be numbers" in info.value.message


def test_binary_bf16_is_two_bytes_an_element():
    x = np.array([1.5, -2.25, 8.0], dtype=np.float32).astype(ml_dtypes.bfloat16)
    header = json.dumps({"inputs": [{"name": "x", "shape": [1, 3], "datatype": "BF16",
                                     "parameters": {"binary_data_size": 6}}]}).encode()
    meta, frame = only(kserve.decode(header + x.tobytes(), str(len(header)), "m", None, 1))
    assert meta.dtype == "bfloat16" and bytes(frame.buffer) == x.tobytes()


def reply(*metas: TensorMeta) -> InferReply:
    return InferReply(v=1, id=1, model="m", version="1", outputs=list(metas))


def test_replies_of_bytes_and_bf16_in_json():
    bf = np.array([[1.5, -0.25]], np.float32).astype(ml_dtypes.bfloat16)
    header, blobs = kserve.encode(reply(TensorMeta(name="s", dtype="bytes", shape=[1, 2]),
                                        TensorMeta(name="b", dtype="bfloat16", shape=[1, 2])),
                                  [pack(["é", b"x"]), bf.tobytes()], None, False)
    doc = orjson.loads(header)
    assert blobs == []
    assert doc["outputs"][0] == {"name": "s", "datatype": "BYTES", "shape": [1, 2], "data": ["é", "x"]}
    assert doc["outputs"][1] == {"name": "b", "datatype": "BF16", "shape": [1, 2], "data": [1.5, -0.25]}


def test_replies_of_bytes_and_bf16_in_binary():
    raw, bits = pack([b"\xff\xfe", b""]), np.array([1, 2], np.uint16).tobytes()
    header, blobs = kserve.encode(reply(TensorMeta(name="s", dtype="bytes", shape=[2]),
                                        TensorMeta(name="b", dtype="bfloat16", shape=[2])), [raw, bits], None, True)
    doc = orjson.loads(header)
    assert [o["parameters"]["binary_data_size"] for o in doc["outputs"]] == [len(raw), 4] and blobs == [raw, bits]


def test_bytes_that_are_no_utf8_need_the_binary_extension():
    metas = reply(TensorMeta(name="s", dtype="bytes", shape=[2]))
    with pytest.raises(TgwError) as info:
        kserve.encode(metas, [pack([b"ok", b"\xff\xfe"])], None, False)
    err = info.value
    assert err.code is Code.INVALID_ARGUMENT and err.http_status == 400
    assert "'s'" in err.message and "binary_data" in err.message
    header, blobs = kserve.encode(metas, [pack([b"ok", b"\xff\xfe"])], None, frozenset({"s"}))
    assert blobs == [pack([b"ok", b"\xff\xfe"])]


def test_metadata_names_the_new_datatypes():
    assert kserve.DATATYPE_OF["bytes"] == "BYTES" and kserve.DATATYPE_OF["bfloat16"] == "BF16"
