"""What a stage returned, checked against its declared outputs and made ready for the output
arena: fixed dtypes as C-contiguous CPU torch tensors, `bytes` outputs packed (PackedBytes).

Every mismatch is a StageOutputError naming the stage and the output (the batch then fails
MODEL_EXECUTION_ERROR, as a model returning the wrong thing does).
"""
from __future__ import annotations

import numpy as np
import torch

from tgw.shm.bytes_tensor import BYTES, BytesTensorError, pack
from tgw.shm.wire import IOSpec

from .runner import TORCH_DTYPES


class StageOutputError(RuntimeError):
    """A stage's result does not fit its declared outputs."""


class PackedBytes:
    """A `bytes` output laid as shm.bytes_tensor lays it: `data`, the C-order elements of a
    [rows, *dims] tensor; `cuts`, where each row begins in it, and the end (rows + 1 entries)."""

    def __init__(self, data: bytes, cuts: list[int], shape: list[int]):
        self.data, self.cuts, self.shape = data, cuts, shape

    @property
    def nbytes(self) -> int:
        return len(self.data)

    def span(self, lo: int, hi: int) -> int:
        """Bytes of rows lo..hi-1."""
        return self.cuts[hi] - self.cuts[lo]

    def __getitem__(self, rows: slice) -> "PackedBytes":
        lo, hi, _ = rows.indices(len(self.cuts) - 1)
        base = self.cuts[lo]
        return PackedBytes(self.data[base:self.cuts[hi]], [c - base for c in self.cuts[lo:hi + 1]],
                           [hi - lo, *self.shape[1:]])


def host_outputs(label: str, decls: list[IOSpec], result, rows: int) -> list:
    """`result` (a dict by output name, a tuple/list in declared order, or - one output - the
    value itself) as the outputs in declared order, each checked."""
    values = _by_declaration(label, decls, result)
    return [_packed(label, d, v, rows) if d.dtype == BYTES else _tensor(label, d, v, rows)
            for d, v in zip(decls, values)]


def _by_declaration(label: str, decls: list[IOSpec], result) -> list:
    names = [d.name for d in decls]
    if isinstance(result, dict):
        missing = [n for n in names if n not in result]
        if missing:
            raise StageOutputError(f"{label} returned keys {sorted(map(str, result))}, missing declared outputs "
                                   f"{missing}")
        return [result[n] for n in names]
    if len(decls) == 1 and isinstance(result, (torch.Tensor, np.ndarray)):
        return [result]
    if isinstance(result, (tuple, list)) and len(result) == len(names):
        return list(result)
    what = f"{len(result)} values" if isinstance(result, (tuple, list)) else type(result).__name__
    raise StageOutputError(f"{label} returned {what}; expected a dict of its outputs {names} (or a tuple of "
                           f"{len(names)} in that order)")


def _declared(decl: IOSpec, rows: int) -> str:
    return f"[{', '.join(map(str, [rows, *decl.shape]))}] (-1 = any)"


def _fits(decl: IOSpec, shape: list[int], rows: int) -> bool:
    return len(shape) == len(decl.shape) + 1 and shape[0] == rows and all(
        d == -1 or d == s for d, s in zip(decl.shape, shape[1:]))


def _tensor(label: str, decl: IOSpec, value, rows: int) -> torch.Tensor:
    where = f"{label}: output {decl.name!r}"
    if isinstance(value, np.ndarray):
        if value.dtype.name != decl.dtype:
            raise StageOutputError(f"{where} is a numpy array of {value.dtype.name}, declared {decl.dtype}")
        array = np.ascontiguousarray(value)
        value = torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16) if decl.dtype == "bfloat16" else \
            torch.from_numpy(array)
    elif not isinstance(value, torch.Tensor):
        raise StageOutputError(f"{where} is {type(value).__name__}; a {decl.dtype} output is a torch tensor or a "
                               "numpy array")
    if value.dtype != TORCH_DTYPES[decl.dtype]:
        raise StageOutputError(f"{where} is {str(value.dtype).removeprefix('torch.')}, declared {decl.dtype}")
    if not _fits(decl, list(value.shape), rows):
        raise StageOutputError(f"{where} has shape {list(value.shape)}, declared {_declared(decl, rows)}")
    return value.detach().to("cpu").contiguous()


def _packed(label: str, decl: IOSpec, value, rows: int) -> PackedBytes:
    where = f"{label}: output {decl.name!r}"
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or len(value) != rows:
        got = f"{len(value)} rows" if isinstance(value, (list, tuple)) else type(value).__name__
        raise StageOutputError(f"{where} is {got}; a bytes output is a list of {rows} rows (one per batch row)")
    dims: list[int] | None = None   # one tensor: every row has the same dims
    blobs, cuts = [], [0]
    for row, item in enumerate(value):
        flat: list = []
        got = _flatten(where, item, len(decl.shape), flat, f"row {row}")
        if dims is None:
            if any(d != -1 and d != g for d, g in zip(decl.shape, got)):
                raise StageOutputError(f"{where}, row {row}: dims {got}, declared {decl.shape} (-1 = any)")
            dims = got
        elif got != dims:
            raise StageOutputError(f"{where}, row {row}: dims {got}, row 0 has {dims} (the rows form one tensor)")
        try:
            blob = pack(flat)
        except (TypeError, BytesTensorError) as exc:
            raise StageOutputError(f"{where}, row {row}: {exc}") from None
        blobs.append(blob)
        cuts.append(cuts[-1] + len(blob))
    shape = [rows, *(dims if dims is not None else [max(d, 0) for d in decl.shape])]
    return PackedBytes(b"".join(blobs), cuts, shape)


def _flatten(where: str, item, depth: int, out: list, at: str) -> list[int]:
    """Append `item`'s elements (C order) to `out`; its dims (`depth` of them: nested lists of
    equal lengths, bytes or str at the bottom)."""
    if depth == 0:
        if not isinstance(item, (bytes, bytearray, memoryview, str)):
            raise StageOutputError(f"{where}, {at}: an element is {type(item).__name__}, not bytes or str")
        out.append(item)
        return []
    if isinstance(item, np.ndarray):
        item = item.tolist()
    if not isinstance(item, (list, tuple)):
        raise StageOutputError(f"{where}, {at}: {type(item).__name__} where a list is declared ({depth} more dims)")
    inner = None
    for k, sub in enumerate(item):
        got = _flatten(where, sub, depth - 1, out, f"{at}[{k}]")
        if inner is not None and got != inner:
            raise StageOutputError(f"{where}, {at}: ragged lists ({at}[{k}] has dims {got}, {at}[0] {inner})")
        inner = got
    return [len(item), *(inner if inner is not None else [0] * (depth - 1))]
