"""The shapes a worker calls a model with (workers/model_shapes.py): Triton's reshape per row,
no batch dim for max_batch_size 0, and back to the declared shapes after the call."""
from __future__ import annotations

import torch

from tgw.shm.wire import IOSpec, ModelSpec
from tgw.workers.model_shapes import from_model, plain, stage_inputs, stage_result, to_model


def spec(inputs, outputs, batched=True) -> ModelSpec:
    return ModelSpec(name="m", version="1", path="", inputs=inputs, outputs=outputs, batched=batched)


def test_reshape_carries_the_variable_dims_in_order_both_ways():
    s = spec([IOSpec(name="x", dtype="float32", shape=[-1, 6], reshape=[-1, 2, 3])],
             [IOSpec(name="y", dtype="float32", shape=[-1, 6], reshape=[-1, 3, 2])])
    assert not plain(s)
    (x,) = to_model(s, [torch.arange(2 * 5 * 6.).reshape(2, 5, 6)])
    assert x.shape == (2, 5, 2, 3)
    (y,) = from_model(s, [torch.zeros(2, 5, 3, 2)])
    assert y.shape == (2, 5, 6)


def test_no_batch_dim_takes_the_one_row_off_and_puts_it_back():
    s = spec([IOSpec(name="x", dtype="float32", shape=[3, 4])], [IOSpec(name="y", dtype="float32", shape=[4])],
             batched=False)
    (x,) = to_model(s, [torch.ones(1, 3, 4)])
    assert x.shape == (3, 4)
    (y,) = from_model(s, [x.sum(0)])
    assert y.shape == (1, 4)
    assert from_model(s, ["not a tensor"]) == ["not a tensor"]   # left for the output check to name


def test_a_stage_gets_its_tensors_shaped_and_bytes_as_they_are():
    s = spec([IOSpec(name="x", dtype="float32", shape=[2]), IOSpec(name="s", dtype="bytes", shape=[1])],
             [IOSpec(name="y", dtype="float32", shape=[2])], batched=False)
    got = stage_inputs(s, {"x": torch.ones(1, 2), "s": [[b"a"]]})
    assert got["x"].shape == (2,) and got["s"] == [[b"a"]]
    assert stage_result(s, {"y": torch.ones(2)})["y"].shape == (1, 2)
    assert stage_result(s, torch.ones(2)).shape == (1, 2)
    plain_spec = spec([IOSpec(name="x", dtype="float32", shape=[2])], [IOSpec(name="y", dtype="float32", shape=[2])])
    inputs = {"x": torch.ones(3, 2)}
    assert plain(plain_spec) and stage_inputs(plain_spec, inputs) is inputs
