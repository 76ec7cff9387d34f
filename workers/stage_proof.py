"""A stage version proves itself before it serves (docs/STAGES.md "Warm-up inputs"): the worker
calls it once at load with each example of its config's `warmup_inputs`, as a one-row batch.

An exception, outputs that break the declared outputs (name, dtype, shape), or a row the stage
fails on its own example fail the load with the handler's own message and the file:line of its
code (the innermost frame in the handler's file); the broker then keeps the old version
serving. A stage that declares no examples loads as before, and says so once in the log.

The examples are one row each: their values are the declared inputs' without the batch dim, in
the vocabulary broker/config/schema_models.example_problem checks. Nothing here is about stages
in particular but `StageRunner.call`: a later contract (a generator's) can prove itself the same way.
"""
from __future__ import annotations

import base64
import logging
import os
from typing import Any, Callable

import torch

from tgw.shm.bytes_tensor import BYTES
from tgw.shm.wire import IOSpec

from .failure_where import code_where, definition_where
from .runner import TORCH_DTYPES
from .stage_outputs import StageOutputError

log = logging.getLogger("tgw.worker")
_said_unproven: set[str] = set()   # stage keys told "no warmup_inputs" in this process (once each)


class StageProofError(RuntimeError):
    """A stage version failed on one of its own warm-up examples: it is not served."""


def example_inputs(inputs: list[IOSpec], example: dict[str, Any], folder: str,
                   device: torch.device = torch.device("cpu")) -> dict[str, Any]:
    """One example as a stage's one-row batch sees it: a [1, *dims] tensor on `device` per
    fixed-dtype input, a one-row nested list of bytes per bytes input (`file` elements read
    from `folder`)."""
    out = {}
    for t in inputs:
        value = example.get(t.name)
        if t.dtype == BYTES:
            out[t.name] = [_bytes(value, folder)]
        elif value == "zeros":
            out[t.name] = torch.zeros([1, *(1 if d == -1 else d for d in t.shape)], dtype=TORCH_DTYPES[t.dtype],
                                      device=device)
        else:
            out[t.name] = torch.tensor([value], dtype=TORCH_DTYPES[t.dtype], device=device)
    return out


def _bytes(value: Any, folder: str) -> Any:
    if isinstance(value, list):
        return [_bytes(v, folder) for v in value]
    if isinstance(value, str):
        return value.encode()
    if "base64" in value:
        return base64.b64decode(value["base64"], validate=True)
    path = os.path.join(folder, value["file"])
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise StageProofError(f"warmup_inputs file {value['file']!r} cannot be read from the handler's folder "
                              f"{folder or '(none)'}: {exc.strerror or exc}") from None


def prove(label: str, key: str, spec_inputs: list[IOSpec], examples: list[dict[str, Any]], folder: str,
          call: Callable[[dict[str, Any], int], tuple[list, dict[int, str]]], code: Any, code_file: str,
          device: torch.device = torch.device("cpu")) -> None:
    """Call `call(inputs, 1)` on each example; raise StageProofError naming the example, the
    handler's message and where in `code_file` (the handler's file) it came from. `code` is the
    callable whose definition a wrong return is blamed on (its __call__); `device`, where the
    stage's fixed-dtype inputs are (a `device: cuda` stage's GPU, as in serving)."""
    if not examples:
        if key not in _said_unproven:
            _said_unproven.add(key)
            log.warning("%s declares no warmup_inputs: it serves without being tried first (docs/STAGES.md, "
                        "\"Warm-up inputs\")", label)
        return
    for k, example in enumerate(examples):
        what = f"{label}: warmup_inputs[{k}]"
        inputs = example_inputs(spec_inputs, example, folder, device)
        try:
            _, rows_failed = call(inputs, 1)
        except StageOutputError as exc:   # blamed on the __call__ that returned them
            raise StageProofError(f"{what}: {str(exc).removeprefix(label + ': ')} (returned by "
                                  f"{definition_where(code)})") from None
        except Exception as exc:
            where = code_where(exc, code_file)
            raise StageProofError(f"{what} raised {type(exc).__name__}: {exc}" +
                                  (f" (at {where})" if where else "")) from None
        if rows_failed:
            raise StageProofError(f"{what}: the stage failed its own example: {rows_failed[0]} "
                                  f"({definition_where(code)})")

