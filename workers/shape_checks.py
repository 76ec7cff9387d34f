"""Does a loaded program accept every batch the broker may send it? Asked once, at load.

The broker batches 1..max_batch_size rows of the declared shapes, a -1 dim taking any size.
An exported program states what it accepts (its inputs' dims and range constraints): those
are compared with the declaration and every mismatch is refused by name before the model
serves. An AOTInductor package states nothing readable but checks each call against the
ranges it was compiled with, so it is run at the edges (1 and max_batch_size rows, each -1
dim at two sizes) and a refusal there is told in the config's terms. Its smallest batch may be
above 1 (torch specialises sizes 0 and 1): the worker then pads smaller batches up to it.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from tgw.shm.errors import Code, TgwError, fail
from tgw.shm.wire import IOSpec, ModelSpec

from .formats import Dim, FormatMismatch, Program, aoti_input_problem, aoti_smallest_batch

VARIABLE_SIZE = 8          # a -1 dim's size in warm-up batches, where the program allows it


def out_of_range(message: str) -> TgwError:
    """A request's variable dim lies outside what the program accepts: the caller's error."""
    return fail(Code.INVALID_ARGUMENT, message, reason="dim_out_of_range")


def dim_name(t: IOSpec, k: int) -> str:
    """Tensor dim k (0: batch) of an input, in the config's terms."""
    return f"input {t.name!r} batch dim" if k == 0 else f"input {t.name!r} shape[{k - 1}] (tensor dim {k})"


def _span(d: Dim) -> str:
    if isinstance(d, int):
        return f"static {d}"
    return "dynamic" if d is None else f"{d[0]}..{'any' if d[1] is None else d[1]}"


def _allows(d: Dim, size: int) -> bool:
    if isinstance(d, int):
        return d == size
    return d is None or (d[0] <= size and (d[1] is None or size <= d[1]))


def export_refusals(spec: ModelSpec, program: Program) -> list[str]:
    """Each way the exported program's inputs differ from the declaration, in words."""
    if program.dims is None:
        return []
    if len(program.dims) != len(spec.inputs):
        return [f"the program takes {len(program.dims)} input(s) {program.names}; the config declares "
                f"{len(spec.inputs)} {[t.name for t in spec.inputs]}"]
    problems = []
    for t, dims, dtype in zip(spec.inputs, program.dims, program.dtypes or []):
        in_program = str(dtype).removeprefix("torch.")
        if dtype is not None and in_program != t.dtype:
            problems.append(f"input {t.name!r} is {t.dtype} in the config but {in_program} in the program")
        if len(dims) != len(t.shape) + 1:
            problems.append(f"input {t.name!r} has {len(dims)} dims in the program; the config declares "
                            f"{len(t.shape)} after the batch dim")
            continue
        problems += _batch_problems(spec, t, dims[0])
        for k, (want, d) in enumerate(zip(t.shape, dims[1:]), start=1):
            if want == -1 and isinstance(d, int):
                problems.append(f"{dim_name(t, k)} is declared -1 (variable) but is static {d} in the exported "
                                f"program: export it with a Dim for that dim, or declare {d}")
            elif want != -1 and not _allows(d, want):
                problems.append(f"{dim_name(t, k)} is declared {want}; the program allows {_span(d)}")
    return problems


def _batch_problems(spec: ModelSpec, t: IOSpec, d: Dim) -> list[str]:
    top = max(spec.max_batch_size, *spec.warmup_batch_sizes, 1)
    if _allows(d, 1) and _allows(d, top):
        return []
    outside = [b for b in sorted({1, spec.max_batch_size, *spec.warmup_batch_sizes}) if b and not _allows(d, b)]
    return [f"{dim_name(t, 0)} allows {_span(d)} in the program, but the broker batches 1..{spec.max_batch_size} "
            f"rows (max_batch_size; warmup_batch_sizes {spec.warmup_batch_sizes}): {outside} fall outside. Export "
            f"with dynamic_shapes {{0: torch.export.Dim('batch', min=1, max={spec.max_batch_size})}} or lower "
            "max_batch_size"]


def example_size(program: Program, i: int, k: int) -> int:
    """The size a -1 dim takes in warm-up batches: VARIABLE_SIZE, moved into the program's range."""
    d = program.dims[i][k] if program.dims and i < len(program.dims) and k < len(program.dims[i]) else None
    if isinstance(d, tuple):
        return max(d[0], VARIABLE_SIZE) if d[1] is None else min(max(d[0], VARIABLE_SIZE), d[1])
    return VARIABLE_SIZE


def check_request_dims(spec: ModelSpec, program: Program, inputs: list[torch.Tensor]) -> None:
    """INVALID_ARGUMENT when a batch's variable dim lies outside the exported program's range
    (only requests with that very shape share the batch, so only they fail)."""
    if program.dims is None:
        return
    for t, dims, x in zip(spec.inputs, program.dims, inputs):
        for k, want in enumerate(t.shape, start=1):
            if want == -1 and not _allows(dims[k], x.shape[k]):
                raise out_of_range(f"{dim_name(t, k)} is {x.shape[k]}; the model allows {_span(dims[k])}")


def aoti_edges(spec: ModelSpec, run: Callable[[int, Optional[tuple[int, int, int]]], None]) -> int:
    """Find the smallest batch the AOTInductor program takes, then run it at that, at
    max_batch_size rows and at each warm-up size (those below the smallest raised to it), then
    with each -1 dim one larger; FormatMismatch naming the dim it refused. `run(rows, (input,
    dim, size) or None)` forwards one batch of example inputs. Returns the smallest batch: 1,
    unless torch specialised sizes 0 and 1 when compiling (then smaller batches are padded)."""
    smallest = _smallest_batch(spec, run)
    sizes = {max(rows, smallest) for rows in (1, spec.max_batch_size or 1, *spec.warmup_batch_sizes)}
    probes = [(rows, None) for rows in sorted(sizes - {smallest})]
    probes += [(smallest, (i, k, VARIABLE_SIZE + 1)) for i, t in enumerate(spec.inputs)
               for k, want in enumerate(t.shape, start=1) if want == -1]
    for rows, change in probes:
        try:
            run(rows, change)
        except RuntimeError as exc:
            problem = aoti_input_problem(exc)
            if problem is None:
                raise
            raise FormatMismatch(_aoti_words(spec, rows, change, *problem)) from None
    return smallest


def _smallest_batch(spec: ModelSpec, run: Callable[[int, None], None]) -> int:
    """A batch of 1 row, else of the least the package says it takes, till one runs."""
    rows, top = 1, spec.max_batch_size or 1
    while True:
        try:
            run(rows, None)
            return rows
        except RuntimeError as exc:
            problem = aoti_input_problem(exc)
            if problem is None:
                raise
            least = aoti_smallest_batch(exc)
            if least is None or least <= rows:
                raise FormatMismatch(_aoti_words(spec, rows, None, *problem)) from None
        if least > top:
            name = dim_name(spec.inputs[problem[0]], 0) if problem[0] < len(spec.inputs) else "the batch dim"
            raise FormatMismatch(f"{name}: the AOTInductor package takes batches of {least} rows or more "
                                 f"({problem[2]}), more than max_batch_size {top}: compile it with a batch Dim "
                                 f"whose min is at most {top}, or raise max_batch_size")
        rows = least


def _aoti_words(spec: ModelSpec, rows: int, change, i: int, k: int, said: str) -> str:
    t = spec.inputs[i] if i < len(spec.inputs) else IOSpec(name=f"#{i}", dtype="?", shape=[])
    if k == 0:
        return (f"{dim_name(t, 0)}: a batch of {rows} rows is refused by the AOTInductor package ({said}); the broker "
                f"batches 1..{spec.max_batch_size} rows (max_batch_size, warmup_batch_sizes "
                f"{spec.warmup_batch_sizes}): compile it with a batch Dim covering them or lower max_batch_size")
    declared = t.shape[k - 1] if k - 1 < len(t.shape) else None
    if declared == -1:
        return (f"{dim_name(t, k)} is declared -1 (variable) but the AOTInductor package refuses a size of it "
                f"({said}): it is static or narrower in the program; export it with a Dim for that dim")
    return f"{dim_name(t, k)} is declared {declared}; the AOTInductor package refuses it ({said})"
