"""tgw's error codes as gRPC statuses: one table, and the abort that carries a TgwError.

The status details read "[CODE] message" (tgw's code first, so a client that only shows the
details still names it); the trailing metadata carries `tgw-code`, `tgw-retryable` and
`tgw-details` (the error's details as JSON), and the request's `traceparent` when it has one,
beside what the call set before (the load report, face.py).
"""
from __future__ import annotations

import grpc
import orjson

from tgw.shm.errors import Code, TgwError

S = grpc.StatusCode
STATUS: dict[Code, grpc.StatusCode] = {
    Code.INVALID_ARGUMENT: S.INVALID_ARGUMENT,
    Code.INVALID_INPUT_SHAPE: S.INVALID_ARGUMENT,
    Code.INVALID_INPUT_DTYPE: S.INVALID_ARGUMENT,
    Code.PAYLOAD_TOO_LARGE: S.RESOURCE_EXHAUSTED,
    Code.UNAUTHENTICATED: S.UNAUTHENTICATED,
    Code.MODEL_NOT_FOUND: S.NOT_FOUND,
    Code.VERSION_NOT_FOUND: S.NOT_FOUND,
    Code.MODEL_NOT_READY: S.UNAVAILABLE,
    Code.RATE_LIMITED: S.RESOURCE_EXHAUSTED,
    Code.OVERLOADED: S.RESOURCE_EXHAUSTED,
    Code.DEADLINE_EXCEEDED: S.DEADLINE_EXCEEDED,
    Code.CIRCUIT_OPEN: S.UNAVAILABLE,
    Code.OUT_OF_GPU_MEMORY: S.RESOURCE_EXHAUSTED,
    Code.OUT_OF_SHM: S.RESOURCE_EXHAUSTED,
    Code.WORKER_DIED: S.UNAVAILABLE,
    Code.MODEL_EXECUTION_ERROR: S.INTERNAL,
    Code.INTERNAL: S.INTERNAL,
    Code.UNAVAILABLE: S.UNAVAILABLE,
}
TRACEPARENT = "traceparent"


def details(err: TgwError) -> str:
    return f"[{err.code.value}] {err.message}"


def trailers(err: TgwError, trace: str | None = None) -> tuple:
    out = [("tgw-code", err.code.value), ("tgw-retryable", "true" if err.retryable else "false"),
           ("tgw-details", orjson.dumps(err.details, default=str).decode())]
    if trace:
        out.append((TRACEPARENT, trace))
    return tuple(out)


def add_trailers(context: grpc.aio.ServicerContext, *pairs: tuple[str, str]) -> None:
    """`pairs` added to the call's trailing metadata (setting it replaces what was set before)."""
    context.set_trailing_metadata(tuple(context.trailing_metadata() or ()) + pairs)


async def abort(context: grpc.aio.ServicerContext, err: TgwError, trace: str | None = None):
    """End the call with the error's status (raises grpc.aio.AbortError, as context.abort does),
    its trailers added to those already set."""
    await context.abort(STATUS.get(err.code, S.INTERNAL), details(err),
                        tuple(context.trailing_metadata() or ()) + trailers(err, trace))
