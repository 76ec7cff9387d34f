"""The shapes a model file is called with when they differ from the request's: Triton's
`reshape` (the model's own shape of a tensor, per row) and models without a batch dim
(max_batch_size 0, ModelSpec.batched False: the broker sends one row, the model gets it without
the batch dim). Inputs go to the model's shapes before the call, outputs come back to the
declared `[rows, *shape]` after it; a plain spec passes through untouched.

A reshape's -1 dims take, in order, the sizes of the declared shape's -1 dims (Triton's rule;
the broker's config check made their counts equal).
"""
from __future__ import annotations

import msgspec
import numpy as np
import torch

from tgw.shm.wire import IOSpec, ModelSpec


def plain(spec: ModelSpec) -> bool:
    """Whether the model takes and returns the declared shapes with the batch dim first."""
    return spec.batched and all(t.reshape is None for t in (*spec.inputs, *spec.outputs))


def _carried(src_decl: list[int], src: list[int], dst_decl: list[int]) -> list[int]:
    """`dst_decl` with its -1 dims filled, in order, by the sizes `src` has at `src_decl`'s -1 dims."""
    sizes = iter([n for d, n in zip(src_decl, src) if d == -1])
    return [next(sizes, -1) if d == -1 else d for d in dst_decl]


def to_model(spec: ModelSpec, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The batch's inputs ([rows, *shape]) as the model takes them."""
    out = []
    if not spec.batched and any(x.shape[0] != 1 for x in inputs):   # the broker's rule: never two requests
        raise ValueError(f"model {spec.name!r} has no batch dim: a batch holds one request, got "
                         f"{[list(x.shape) for x in inputs]}")
    for t, x in zip(spec.inputs, inputs):
        if t.reshape is not None:
            x = x.reshape(x.shape[0], *_carried(t.shape, list(x.shape[1:]), t.reshape))
        out.append(x if spec.batched else x[0])
    return out


def from_model(spec: ModelSpec, outs: list) -> list:
    """The model's outputs (in declared order) as declared: `[rows, *shape]`. A value that is no
    tensor is left for the output check to name."""
    return [_back(spec, t, y) for t, y in zip(spec.outputs, outs)]


def _back(spec: ModelSpec, t: IOSpec, y):
    if isinstance(y, np.ndarray):
        y = torch.from_numpy(y)
    if not isinstance(y, torch.Tensor):
        return y
    if not spec.batched:
        y = y.unsqueeze(0)
    if t.reshape is not None and y.dim() == len(t.reshape) + 1:
        y = y.reshape(y.shape[0], *_carried(t.reshape, list(y.shape[1:]), t.shape))
    return y


def stage_inputs(spec: ModelSpec, inputs: dict) -> dict:
    """A stage's batch inputs as it takes them: tensors per to_model; bytes inputs (lists of rows)
    stay as they are."""
    if plain(spec):
        return inputs
    tensors = [t for t in spec.inputs if isinstance(inputs.get(t.name), torch.Tensor)]
    shaped = to_model(_with_inputs(spec, tensors), [inputs[t.name] for t in tensors])
    return {**inputs, **{t.name: x for t, x in zip(tensors, shaped)}}


def stage_result(spec: ModelSpec, result):
    """A stage's result with its tensors back in the declared shapes (a dict by name, a tuple in
    declared order, or one output's value)."""
    if plain(spec):
        return result
    by_name = {t.name: t for t in spec.outputs}
    if isinstance(result, dict):
        return {k: _back(spec, by_name[k], v) if k in by_name else v for k, v in result.items()}
    if isinstance(result, (tuple, list)) and len(result) == len(spec.outputs):
        return [_back(spec, t, v) for t, v in zip(spec.outputs, result)]
    if len(spec.outputs) == 1:
        return _back(spec, spec.outputs[0], result)
    return result


def _with_inputs(spec: ModelSpec, inputs: list[IOSpec]) -> ModelSpec:
    return msgspec.structs.replace(spec, inputs=inputs)
