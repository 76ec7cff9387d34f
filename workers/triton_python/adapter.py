"""A Triton Python-backend model (`TritonPythonModel`: `initialize(args)`, `execute(requests)`,
`finalize()`) served as a tgw stage (docs/MIGRATING.md, "Python-backend models").

At setup: the model's config document (options.triton_model_config as tritonrepo translated
it, else synthesised from the declared inputs and outputs), `auto_complete_config` called when
the class defines it (its changes are ignored, with a warning: tgw serves what is declared),
decoupled models refused, then `initialize(args)` with Triton's args. Per batch: one
InferenceRequest per request of the batch (its own rows, its own batch dim; none for a model of
max_batch_size 0), execute(), and each response's tensors checked against the declared outputs
and joined in request order; a response with an error (or a tensor that does not fit) fails
its request alone. `finalize()` runs when the stage is unloaded or its worker exits.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import weakref
from typing import Any

import numpy as np
import torch

from tgw.shm.bytes_tensor import BYTES
from tgw.shm.errors import Code
from tgw.shm.wire import IOSpec, ModelSpec

from ..failure_where import code_where
from ..stage import RowFailure, StageBatch, StageContext
from . import backend_utils
from .errors import TritonError
from .messages import InferenceRequest, InferenceResponse
from .model_config import ModelConfig, normalised, synthesised, using_decoupled_model_transaction_policy
from .tensors import BY_TGW_DTYPE, TYPES, Tensor, element_bytes, object_array

log = logging.getLogger("tgw.worker")
# a TritonError's code -> tgw's: the same HTTP status where tgw has an honest code for it
# (INTERNAL 500, UNAVAILABLE 503); the others are answered 400, as Triton answers most of them
ERROR_CODES = {TritonError.INTERNAL: Code.MODEL_EXECUTION_ERROR, TritonError.UNAVAILABLE: Code.MODEL_NOT_READY}


class TritonModelLoadError(RuntimeError):
    """A Triton Python model that cannot be served: its message names the model and the cause."""


class TritonStage:
    """The stage a worker serves for a class with `execute` and no `__call__`."""

    def __init__(self, cls: type, spec: ModelSpec):
        self.cls, self.spec = cls, spec
        self.label = f"Triton Python model {spec.name!r} (version {spec.version})"
        self.file = os.path.abspath(getattr(sys.modules.get(cls.__module__), "__file__", "") or "")
        self.model = cls()
        self.config: dict = {}
        self.loop: asyncio.AbstractEventLoop | None = None   # for an `async def execute`

    def setup(self, context: StageContext) -> None:
        given = self.spec.options.get("triton_model_config")
        self.config = normalised(given if given is not None else synthesised(self.spec))
        self.config.setdefault("name", self.spec.name)
        if getattr(self.cls, "auto_complete_config", None) is not None:
            self._auto_complete()
        if using_decoupled_model_transaction_policy(self.config):
            raise TritonModelLoadError(f"{self.label}: decoupled mode (model_transaction_policy {{ decoupled: true }}) "
                                       "is not supported: tgw answers one response per request; make execute() return "
                                       "one InferenceResponse per request")
        folder = os.path.dirname(self.file)
        backend_utils.current_model_dir = folder
        kind = "GPU" if context.device.type == "cuda" else "CPU"
        args = {"model_config": json.dumps(self.config), "model_instance_kind": kind,
                "model_instance_name": f"{self.spec.name}_0_0",
                "model_instance_device_id": str(context.device.index or 0),
                # Triton's is the model's folder (REPO/M) of REPO/M/V/model.py
                "model_repository": os.path.dirname(folder) if os.path.basename(folder).isdigit() else folder,
                "model_version": self.spec.version, "model_name": self.spec.name}
        initialize = getattr(self.model, "initialize", None)
        if initialize is not None:
            self._guarded("initialize", initialize, args)
        weakref.finalize(self, _finalize, self.model, self.label)

    def _guarded(self, what: str, fn, *args):
        try:
            return fn(*args)
        except Exception as exc:
            where = code_where(exc, self.file)
            raise TritonModelLoadError(f"{self.label}: {what}() raised {type(exc).__name__}: {exc}"
                                       + (f" (at {where})" if where else "")) from exc

    def _auto_complete(self) -> None:
        before = json.loads(json.dumps(self.config))
        result = self._guarded("auto_complete_config", self.cls.auto_complete_config, ModelConfig(json.dumps(before)))
        if not isinstance(result, ModelConfig):
            raise TritonModelLoadError(f"auto_complete_config function in model '{self.spec.name}' must return a "
                                       "valid pb.ModelConfig object.")
        after = result.as_dict()
        if using_decoupled_model_transaction_policy(after):
            self.config.setdefault("model_transaction_policy", {})["decoupled"] = True
        elif after != before:
            changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
            log.warning("%s: auto_complete_config changed %s; tgw ignores the change and serves the inputs, outputs "
                        "and max_batch_size declared in its config", self.label, ", ".join(changed))

    def __call__(self, batch: StageBatch) -> dict[str, Any]:
        bounds = batch.starts or [0, batch.rows]
        # fixed-dtype inputs as numpy once (bfloat16, which numpy lacks, stays torch); bytes as lists
        inputs = {t.name: batch[t.name].cpu().numpy() if t.dtype not in (BYTES, "bfloat16") else batch[t.name]
                  for t in self.spec.inputs}
        requests = [self._request(inputs, bounds[i], bounds[i + 1], batch.ids[i] if i < len(batch.ids) else "")
                    for i in range(len(bounds) - 1)]
        backend_utils.current_model_dir = os.path.dirname(self.file)
        responses = self.model.execute(requests)
        if asyncio.iscoroutine(responses):
            self.loop = self.loop or asyncio.new_event_loop()
            responses = self.loop.run_until_complete(responses)
        if responses is None:   # answered through the requests' response senders
            responses = [r._sender.response if r._sender is not None else None for r in requests]
        if not isinstance(responses, list):
            raise backend_utils.TritonModelException(f"Expected a list in the execute return, found type "
                                                     f"'{type(responses)}'.")
        if len(responses) != len(requests):
            raise backend_utils.TritonModelException(
                "Number of InferenceResponse objects do not match the number of InferenceRequest objects. "
                f"InferenceRequest(s) size is:{len(requests)}, and InferenceResponse(s) size is:{len(responses)}")
        return self._outputs(batch, bounds, responses)

    def _request(self, inputs: dict[str, Any], a: int, b: int, request_id) -> InferenceRequest:
        tensors = [self._input(inputs[t.name], t, a, b) for t in self.spec.inputs]
        version = int(self.spec.version) if self.spec.version.isdigit() else -1
        return InferenceRequest(request_id=str(request_id), inputs=tensors,
                                requested_output_names=[t.name for t in self.spec.outputs],
                                model_name=self.spec.name, model_version=version)

    def _input(self, value, t: IOSpec, a: int, b: int) -> Tensor:
        """Rows a..b of an input as the model reads it, in its own shape (model_shapes.py made
        fixed-dtype inputs so: Triton's reshape, no batch dim for max_batch_size 0): a numpy copy
        (the ring is read-only to a stage; Triton's models may write theirs); BYTES as an object
        array of bytes; bfloat16, which numpy lacks, as a torch tensor (to_dlpack)."""
        if t.dtype == BYTES:
            array = object_array(*_flattened(value[a:b], 1 + len(t.shape)))
            if t.reshape is not None:
                array = array.reshape([b - a, *t.reshape])
            return Tensor(t.name, array if self.spec.batched else array[0])
        rows = value[a:b] if self.spec.batched else value   # unbatched: one request, its rows dim gone
        if t.dtype == "bfloat16":
            return Tensor.from_dlpack(t.name, rows.cpu().clone())
        return Tensor(t.name, rows.copy())

    def _outputs(self, batch: StageBatch, bounds: list[int], responses: list) -> dict[str, Any]:
        """The responses' tensors joined per output in request order: BYTES as declared (nested
        lists of [rows, *shape]); fixed dtypes in the model's own shape, which model_shapes.py
        brings back to the declared one."""
        per_output: dict[str, list] = {t.name: [] for t in self.spec.outputs}
        for i, response in enumerate(responses):
            a, b = bounds[i], bounds[i + 1]
            found = self._response_arrays(response, b - a)
            if isinstance(found, RowFailure):
                batch.fail_as(a, found)
                found = None
            for t in self.spec.outputs:
                per_output[t.name].append(found[t.name] if found else None)
        out = {}
        for t in self.spec.outputs:
            arrays = per_output[t.name]
            rows_first = self.spec.batched or t.dtype == BYTES
            dims = t.shape if t.dtype == BYTES else _model_dims(t)
            if not rows_first:   # max_batch_size 0: one request, no rows dim
                joined = arrays[0] if arrays[0] is not None else _blank(t, tuple(1 if d == -1 else d for d in dims))
            else:
                joined = self._joined(batch, bounds, t, arrays, dims)
            if t.dtype == BYTES:
                out[t.name] = joined.tolist()
            else:
                tensor = torch.from_numpy(np.ascontiguousarray(joined))
                out[t.name] = tensor.view(torch.bfloat16) if t.dtype == "bfloat16" else tensor
        return out

    def _joined(self, batch: StageBatch, bounds: list[int], t: IOSpec, arrays: list, dims: list[int]) -> np.ndarray:
        """Each request's [rows, *dims] array, or blanks for a failed one, as one [batch rows, *dims]."""
        row_shape = next((x.shape[1:] for x in arrays if x is not None), None)
        for i, x in enumerate(arrays):
            if x is not None and x.shape[1:] != row_shape:
                batch.fail_as(bounds[i], self._broke(
                    f"output {t.name!r} has shape {list(x.shape)}, another request of its batch "
                    f"{[x.shape[0], *row_shape]}: tgw batches a variable dim at one size"))
                arrays[i] = None
        row_shape = row_shape if row_shape is not None else tuple(1 if d == -1 else d for d in dims)
        arrays = [x if x is not None else _blank(t, (bounds[i + 1] - bounds[i], *row_shape))
                  for i, x in enumerate(arrays)]
        return np.concatenate(arrays) if len(arrays) > 1 else arrays[0]

    def _broke(self, problem: str) -> RowFailure:
        """A request failed because the model's response breaks the declaration: the model's fault."""
        return RowFailure(f"{self.label}: {problem}", Code.MODEL_EXECUTION_ERROR)

    def _response_arrays(self, response, rows: int) -> dict[str, np.ndarray] | RowFailure:
        """A response's outputs as [rows, *dims] arrays, or why its request fails."""
        if response is None:
            return self._broke("execute() gave no InferenceResponse for this request (none in its list, none sent)")
        if not isinstance(response, InferenceResponse):
            raise backend_utils.TritonModelException("Expected an 'InferenceResponse' object in the execute function "
                                                     f"return list, found type '{type(response)}'.")
        if response.has_error():   # the model's own message, as Triton answers it
            error = response.error()
            return RowFailure(error.message(), ERROR_CODES.get(error.code(), Code.INVALID_ARGUMENT))
        given = {t.name(): t for t in response.output_tensors()}
        out = {}
        for t in self.spec.outputs:
            if t.name not in given:
                return self._broke(f"the response has no output {t.name!r} (it has {sorted(given)}): tgw answers "
                                   "every declared output")
            array, problem = _checked(given[t.name], t, self.spec.batched, rows)
            if problem:
                return self._broke(problem)
            out[t.name] = array
        return out


def _model_dims(t: IOSpec) -> list[int]:
    """A tensor's shape as the model takes or returns it, without the batch dim."""
    return t.reshape if t.reshape is not None else t.shape


def _checked(tensor: Tensor, t: IOSpec, batched: bool, rows: int) -> tuple[np.ndarray | None, str]:
    """One output tensor checked against its declaration, or why not: its numpy array in the
    model's own shape (bfloat16 as its int16 bits), BYTES in the declared [rows, *shape]."""
    declared = TYPES[BY_TGW_DTYPE[t.dtype]][0]
    if t.dtype == "bfloat16":
        value = tensor.as_torch().cpu()
        if value.dtype != torch.bfloat16:
            return None, f"output {t.name!r} is {value.dtype}, its config declares {declared}"
        array = value.contiguous().view(torch.int16).numpy()
    else:
        array = tensor.as_numpy() if tensor.is_cpu() else tensor.as_torch().cpu().numpy()
        if t.dtype == BYTES:
            if array.dtype != np.object_ and array.dtype.type != np.bytes_:
                return None, (f"output {t.name!r} is {array.dtype}, its config declares {declared} (an object array "
                              "of bytes)")
            array = object_array([element_bytes(x) for x in array.ravel().tolist()], list(array.shape))
        elif array.dtype != np.dtype(TYPES[BY_TGW_DTYPE[t.dtype]][1]):
            return None, f"output {t.name!r} is {array.dtype}, its config declares {declared}"
    dims = list(_model_dims(t))
    want = [rows, *dims] if batched else dims
    if array.ndim != len(want) or any(w not in (-1, g) for w, g in zip(want, array.shape)):
        expect = f"['rows', {', '.join(map(str, dims))}] (rows: {rows}, the request's batch)" if batched else str(dims)
        return None, f"output {t.name!r} has shape {list(array.shape)}, its config declares {expect}"
    if t.dtype == BYTES:   # to the declared shape: the rows dim back, Triton's reshape undone
        array = array if batched else array[None]
        if t.reshape is not None:
            try:
                array = array.reshape([array.shape[0], *t.shape])
            except ValueError:
                return None, f"output {t.name!r} of shape {list(array.shape)} does not reshape to {t.shape}"
    return array, ""


def _blank(t: IOSpec, shape: tuple) -> np.ndarray:
    """A failed request's values (ignored), in the form its output is joined in."""
    if t.dtype == BYTES:
        return object_array([b""] * int(np.prod(shape)), list(shape))
    if t.dtype == "bfloat16":
        return np.zeros(shape, np.int16)
    return np.zeros(shape, TYPES[BY_TGW_DTYPE[t.dtype]][1])


def _flattened(rows: list, depth: int) -> tuple[list, list[int]]:
    """Nested lists `depth` deep (the rows first) as their C-order items and their shape."""
    shape, level = [], rows
    for _ in range(depth):
        shape.append(len(level))
        level = level[0] if len(level) else []
    flat = rows
    for _ in range(depth - 1):
        flat = [x for sub in flat for x in sub]
    return flat, shape


def _finalize(model, label: str) -> None:
    finalize = getattr(model, "finalize", None)
    if finalize is None:
        return
    try:
        finalize()
    except Exception as exc:
        log.warning("%s: finalize() raised %s: %s", label, type(exc).__name__, exc)
