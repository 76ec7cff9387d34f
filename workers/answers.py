"""A batch's answer when it fails: the structured error every request of it (or of a part) gets."""
from __future__ import annotations

from tgw.shm.errors import Code, TgwError, fail
from tgw.shm.wire import Batch, Done

from .cuda_faults import fault_of
from .oom import is_oom, oom_text


def error_done(batch: Batch, code: Code, message: str, **details) -> Done:
    return Done(batch_id=batch.batch_id, error=fail(code, message, **details).to_body())


def failed(batch: Batch, exc: BaseException) -> Done:
    """The answer to a batch (or part) whose forward raised `exc`: out of GPU memory, the
    requests' own fault (a dim outside the program's range), or a model bug. A sticky CUDA
    error is none of these: it raises CudaFault, and the batch is not answered (cuda_faults.py)."""
    fault = fault_of(exc, batch.batch_id)
    if fault is not None:
        raise fault from None
    if is_oom(exc):
        return error_done(batch, Code.OUT_OF_GPU_MEMORY, oom_text(exc))
    if isinstance(exc, TgwError):
        return Done(batch_id=batch.batch_id, error=exc.to_body())
    return error_done(batch, Code.MODEL_EXECUTION_ERROR, f"{type(exc).__name__}: {exc}".strip()[:2000],
                      exception=type(exc).__name__)
