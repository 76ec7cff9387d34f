"""A model that raised on the shapes or values it was given: the caller's mistake, not the model's.

torch states some errors in terms of its operands' sizes (two tensors that must match, a matrix
product whose inner dims differ, an embedding index past its table): raised by a forward on
inputs of the declared dtypes and ranks, they say the request's shapes or values do not fit
one another, so the answer is INVALID_ARGUMENT (HTTP 400) naming the inputs' shapes, not
MODEL_EXECUTION_ERROR. Conservative: only the messages below; any other error stays the
model's own fault (500).
"""
from __future__ import annotations

import re

import torch

from tgw.shm.errors import Code, TgwError, fail

# torch's messages that blame the operands' sizes or indices (TorchScript quotes them inside its traceback)
PATTERNS = [re.compile(p) for p in (
    r"The size of tensor a \(\d+\) must match the size of tensor b \(\d+\)",
    r"The expanded size of the tensor \(\d+\) must match the existing size \(\d+\)",
    r"mat1 and mat2 shapes cannot be multiplied",
    r"\bsize mismatch\b",
    r"Sizes of tensors must match except in dimension",
    r"shape '\[[-\d, ]*\]' is invalid for input of size \d+",
    r"index out of range in self",                      # an embedding's index past its table
    r"Expected size for first two dimensions of batch2 tensor",
    # onnxruntime's (an ONNX model's): an input's dim the graph fixes, operands that do not broadcast
    r"Got invalid dimensions for input",
    r"Attempting to broadcast an axis by a dimension other than 1",
    r"Incompatible dimensions",
)]
MAX_CHARS = 500


def torch_reason(exc: BaseException) -> str | None:
    """The line of `exc`'s message that blames its operands, or None (not a caller's mistake)."""
    if isinstance(exc, (TgwError, torch.cuda.OutOfMemoryError, MemoryError)):
        return None
    for line in str(exc).splitlines():
        if any(p.search(line) for p in PATTERNS):
            return line.strip().removeprefix("RuntimeError: ").removeprefix("IndexError: ")[:MAX_CHARS]
    return None


def rejected(key: str, names: list[str], shapes: list[list[int]], exc: BaseException) -> TgwError | None:
    """INVALID_ARGUMENT naming the inputs' shapes when the model raised on them, else None.
    A batch holds only requests of one shape, so the shapes are each request's (rows aside)."""
    reason = torch_reason(exc)
    if reason is None:
        return None
    sent = ", ".join(f"{n} {list(s)}" for n, s in zip(names, shapes))
    return fail(Code.INVALID_ARGUMENT, f"model {key} rejected its inputs ({sent}): {reason}",
                reason="inputs_rejected_by_model", exception=type(exc).__name__)
