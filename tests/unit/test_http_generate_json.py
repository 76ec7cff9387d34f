"""Triton's generate extension's JSON both ways (broker/faces/http/generate_json.py): keys to
inputs and parameters, shapes from values, refusals by name, and the flat response shapes."""
from __future__ import annotations

import numpy as np
import pytest

from tgw.shm.errors import Code, TgwError
from tgw.shm.wire import IOSpec

from tgw.broker.faces.http import generate_json as gj

pytestmark = pytest.mark.unit
PROMPT = [IOSpec(name="prompt", dtype="int64", shape=[-1])]


def test_keys_become_inputs_and_parameters():
    msg, frames = gj.request({"prompt": [1, 2, 3], "max_tokens": 5, "parameters": {"temperature": 0.5, "seed": 3},
                              "stream": True, "priority": 1, "sequence_id": 9, "sequence_start": True},
                             PROMPT, "g", None, 7, generator=True)
    assert (msg.model, msg.id, msg.priority) == ("g", 7, 1)
    assert msg.inputs[0].shape == [1, 3] and np.frombuffer(frames[0].buffer, np.int64).tolist() == [1, 2, 3]
    assert msg.generate.max_outputs == 5 and msg.generate.sampling.temperature == 0.5
    assert msg.generate.sampling.seed == 3 and msg.sequence.id == 9 and msg.sequence.start
    plain, _ = gj.request({"prompt": 4}, PROMPT, "m", "1", 1, generator=False)
    assert plain.generate is None and plain.inputs[0].shape == [1, 1] and plain.version == "1"


def test_shapes_from_the_value_and_the_declared_shape():
    fixed = IOSpec(name="x", dtype="float32", shape=[2, 2])
    assert gj.shape_of([1, 2, 3, 4], fixed, "x") == [2, 2]
    assert gj.shape_of([[1, 2], [3, 4]], fixed, "x") == [2, 2]
    assert gj.shape_of(5, IOSpec(name="s", dtype="int64", shape=[]), "s") == []
    assert gj.shape_of(5, IOSpec(name="s", dtype="int64", shape=[1]), "s") == [1]
    assert gj.shape_of("hi", IOSpec(name="t", dtype="bytes", shape=[-1]), "t") == [1]
    with pytest.raises(TgwError, match="does not fit the declared shape") as e:
        gj.shape_of([1, 2, 3], fixed, "x")
    assert e.value.code is Code.INVALID_INPUT_SHAPE


@pytest.mark.parametrize("doc,words", [
    ([1], "JSON object"),
    ({}, "needs input(s) 'prompt'"),
    ({"prompt": [1], "temprature": 1.0}, "'temprature' is neither an input"),
    ({"prompt": [1], "max_tokens": 2.5}, "max_tokens must be an integer"),
    ({"prompt": [1], "max_tokens": 2, "parameters": {"max_tokens": 3}}, "given twice"),
    ({"prompt": [1], "stream": "yes"}, "stream must be a boolean"),
    ({"prompt": {"a": 1}}, "a scalar or a list"),
    ({"prompt": [1.5]}, "must be integers"),
    ({"prompt": [1], "classification": 2}, "classification"),
])
def test_bad_requests_are_refused_by_name(doc, words):
    with pytest.raises(TgwError, match=words.replace("(", r"\(").replace(")", r"\)")):
        gj.request(doc, PROMPT, "g", None, 1, generator=True)


def test_generation_parameters_on_a_plain_model_are_refused():
    with pytest.raises(TgwError, match="not a generator"):
        gj.request({"prompt": [1], "max_tokens": 3}, PROMPT, "m", None, 1, generator=False)


def test_response_shapes():
    chunk = {"token": np.array([7, 8], np.int64), "v": np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)}
    assert gj.events("g", "1", chunk) == [{"model_name": "g", "model_version": "1", "token": 7, "v": [1.0, 2.0]},
                                          {"model_name": "g", "model_version": "1", "token": 8, "v": [3.0, 4.0]}]
    doc = gj.collected("g", "2", [chunk, {"token": np.array([9]), "v": np.zeros((1, 2), np.float32)}], ["token"])
    assert doc == {"model_name": "g", "model_version": "2", "token": [7, 8, 9]}
    assert gj.collected("g", "2", [], ["token"])["token"] == []
