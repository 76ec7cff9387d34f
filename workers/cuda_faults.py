"""Sticky CUDA errors: the ones after which every later call in this process fails too.

An illegal memory access, a device-side assert, a launch failure or an ECC error leaves the
CUDA context unusable: torch raises the same error from every later kernel, copy or sync. So
such an error is not the request's answer but the worker's end: the batch is not answered, the
worker tells the broker (WorkerFault) and exits, and the broker retries what it held, alone, on
a fresh process (a new CUDA context). Known by torch's message, as TorchScript rethrows every
error as a RuntimeError with the message inside (as oom.py does for out-of-memory).
"""
from __future__ import annotations

# what torch's messages say, for cudaErrorIllegalAddress, cudaErrorAssert, cudaErrorLaunchFailure,
# cudaErrorECCUncorrectable, cudaErrorMisalignedAddress, cudaErrorIllegalInstruction,
# cudaErrorInvalidPc, cudaErrorHardwareStackError, cudaErrorLaunchTimeout and a lost device
STICKY = (
    "an illegal memory access was encountered",
    "device-side assert triggered",
    "unspecified launch failure",
    "uncorrectable ECC error",
    "misaligned address",
    "an illegal instruction was encountered",
    "invalid program counter",
    "hardware stack error",
    "the launch timed out and was terminated",
)
MAX_ERROR_CHARS = 2000


def sticky_kind(exc: BaseException) -> str:
    """The marker of a sticky CUDA error in `exc`'s message, "" for any other error."""
    # torch.AcceleratorError is a RuntimeError, TorchScript's torch.jit.Error is not: by message alone
    text = str(exc)
    if "CUDA" not in text and "cuda" not in text:
        return ""
    return next((m for m in STICKY if m in text), "")


def error_line(exc: BaseException) -> str:
    """The CUDA line of the message, not the interpreter's traceback around it."""
    text = str(exc)
    at = text.find("CUDA error")
    line = (text[at:] if at >= 0 else text).splitlines()
    return (line[0] if line else type(exc).__name__).strip()[:MAX_ERROR_CHARS]


class CudaFault(Exception):
    """Raised out of the serving loop: the worker must stop and report `batch_id`'s fault."""

    def __init__(self, batch_id: int | None, kind: str, error: str):
        super().__init__(error)
        self.batch_id, self.kind, self.error = batch_id, kind, error


def fault_of(exc: BaseException, batch_id: int | None) -> CudaFault | None:
    """A CudaFault for `exc` when it is a sticky CUDA error, else None."""
    if isinstance(exc, CudaFault):
        return exc
    kind = sticky_kind(exc)
    return CudaFault(batch_id, kind, error_line(exc)) if kind else None
