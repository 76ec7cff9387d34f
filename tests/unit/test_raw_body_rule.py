"""Which HTTP bodies are raw (broker/protocol/kserve.py is_raw) - KServe's JSON and binary
extension exactly as before - and what a raw body becomes or why it is refused."""
from __future__ import annotations

import pytest

from tgw.broker.protocol.kserve import decode_raw, is_raw
from tgw.shm.bytes_tensor import unpack
from tgw.shm.errors import TgwError
from tgw.shm.wire import IOSpec

pytestmark = pytest.mark.unit

RULE = [  # (method, Content-Type, Inference-Header-Content-Length, raw?)
    ("POST", "image/jpeg", None, True),
    ("POST", "application/octet-stream", None, True),
    ("POST", "image/jpeg", "120", False),             # the binary extension, whatever its type
    ("POST", None, None, False),                      # tritonclient, python requests: JSON
    ("POST", "application/json", None, False),
    ("POST", "application/json; charset=utf-8", None, False),
    ("POST", "application/vnd.kserve+json", None, False),
    ("POST", "application/x-www-form-urlencoded", None, False),   # curl -d
    ("POST", "text/plain;charset=UTF-8", None, False),            # fetch() and aiohttp with a string
    ("PUT", None, None, True),                                    # curl -T
    ("PUT", "application/json", None, True),
]


@pytest.mark.parametrize("method,content_type,length,raw", RULE)
def test_which_bodies_are_raw(method, content_type, length, raw):
    assert is_raw(method, content_type, length) is raw


def test_a_raw_body_is_the_one_element_of_the_one_bytes_input():
    d = decode_raw(b"\xff\xd8jpeg", "image/jpeg", [IOSpec(name="image", dtype="bytes", shape=[])], "classify",
                   None, 7, "user-1")
    [meta] = d.infer.inputs
    assert (meta.name, meta.dtype, meta.shape, d.infer.routing_key) == ("image", "bytes", [1], "user-1")
    assert unpack(bytes(d.frames[0].buffer), 1) == [b"\xff\xd8jpeg"] and d.binary is False


@pytest.mark.parametrize("inputs,words", [
    ([IOSpec(name="a", dtype="bytes", shape=[]), IOSpec(name="b", dtype="int64", shape=[2])],
     "takes a BYTES [-1], b INT64 [-1, 2]"),
    ([IOSpec(name="x", dtype="float32", shape=[256])], "takes x FP32 [-1, 256]"),
    ([IOSpec(name="s", dtype="bytes", shape=[-1])], "takes s BYTES [-1, -1]"),
])
def test_a_model_that_cannot_take_a_raw_body_is_named_with_what_it_takes(inputs, words):
    with pytest.raises(TgwError) as refused:
        decode_raw(b"x", "image/png", inputs, "m", None, 1)
    assert refused.value.details["reason"] == "raw_body" and words in str(refused.value)
