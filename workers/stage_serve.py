"""A stage's batch in the serving loop: its inputs as the stage sees them, its call, the rows it
failed as Done.failed, and its outputs written to the output arena (output_blocks.py: whole, or
in parts when they can never fit as one block).

Fixed-dtype inputs are torch views of the ring (copied to the GPU for a `device: cuda` stage);
`bytes` inputs are lists (shm.bytes_tensor.unpack of the ring block, nested by shape). A batch
that runs out of GPU memory is run again in halves at request boundaries, as a model's is. A
batch with requests withdrawn before launch (serve.py) sees the kept requests' rows only.
"""
from __future__ import annotations

import bisect
import math

from tgw.shm.bytes_tensor import BYTES, BytesTensorError, unpack
from tgw.shm.errors import Code, fail
from tgw.shm.wire import Batch, BlockTensor, Done, ErrorBody

from .answers import error_done, failed
from .oom import is_oom, oom_text
from .output_blocks import request_starts
from .sequence_runner import SequenceRunner
from .stage import RowFailure
from .stage_runner import StageRunner


def serve_stage(server, batch: Batch, runner: StageRunner | SequenceRunner) -> Done:
    """The completion of one stage batch (parts but the last are sent on the way); `server`
    (serve.Server) lends its ring views, output blocks and out-of-memory handling. A sequence
    model's batch (sequence_runner.py) is served alike, each piece with its requests' steps."""
    if batch.cuda_inputs or batch.cuda_outputs:
        return error_done(batch, Code.INVALID_ARGUMENT, f"{runner.label} takes its inputs and outputs through "
                          "shared memory; CUDA tensors by IPC handle are for models")
    try:
        inputs = [_input(server, t, runner) for t in batch.inputs]
    except BytesTensorError as exc:
        return error_done(batch, Code.INVALID_ARGUMENT, f"{runner.label}: {exc}")
    starts = request_starts(batch)
    failures: dict[int, str] = {}   # batch row -> the stage's message

    def compute(lo: int, hi: int) -> list:
        a, b = starts[lo], starts[hi]
        named = {t.name: x[a:b] if (a, b) != (0, batch.rows) else x for t, x in zip(batch.inputs, inputs)}
        steps = (batch.steps[lo:hi],) if isinstance(runner, SequenceRunner) else ()
        # a stage is told where its requests begin (a Triton Python model answers per request)
        told = {} if steps else {"starts": [s - a for s in starts[lo:hi + 1]], "ids": batch.ids[lo:hi]}
        outs, rows_failed = runner.call(named, *steps, b - a, **told)
        for row, message in rows_failed.items():
            failures.setdefault(a + row, message)
        return outs

    try:
        outs = compute(0, len(starts) - 1)
    except Exception as exc:
        if not is_oom(exc):
            server.failures.note(batch.batch_id, exc, runner.code_file)   # the handler's file:line, for the log
            return failed(batch, exc)
        text = oom_text(exc)
    else:
        return server.blocks.answer(batch, outs, runner, failed=_failed_requests(runner, failures, starts))
    return server.answer_in_halves(batch, runner, None, compute, text,
                                   row_failures=lambda: _failed_requests(runner, failures, starts))


def _input(server, t: BlockTensor, runner: StageRunner):
    if t.dtype != BYTES:
        view = server.kept_rows(server.view(t))
        return view.to(runner.device) if runner.device.type != "cpu" else view
    count = math.prod(t.shape)
    flat = unpack(server.segment.buf[t.offset:t.offset + t.nbytes], count) if count or t.nbytes else []
    return server.kept_rows(_nested(flat, t.shape))


def _nested(flat: list, shape: list[int]) -> list:
    """The C-order elements `flat` as nested lists of `shape` (its first dim the rows)."""
    if len(shape) <= 1:
        return flat
    inner = math.prod(shape[1:])
    return [_nested(flat[r * inner:(r + 1) * inner], shape[1:]) for r in range(shape[0])]


def _failed_requests(runner: StageRunner, failures: dict[int, str], starts: list[int]) -> dict[int, ErrorBody]:
    """Each request with a failed row -> its error (the first failed row's message)."""
    out: dict[int, ErrorBody] = {}
    for row in sorted(failures):
        request = bisect.bisect_right(starts, row) - 1
        if request not in out:
            message = failures[row]
            code, text = ((Code(message.code), str(message)) if isinstance(message, RowFailure) else
                          (Code.INVALID_ARGUMENT, f"stage {runner.spec.name}: {message}"))
            out[request] = fail(code, text, row=row - starts[request], request=request,
                                reason="stage_row_failed").to_body()
    return out
