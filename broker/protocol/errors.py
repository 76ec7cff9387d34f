"""A TgwError as each face answers it: the refusal helpers, Triton's JSON error shape, and the
gRPC status and trailing metadata of each code, as data.

The HTTP status of each code is the wire contract's (tgw.shm.errors.ERROR_TABLE, which the
native client reads too); the gRPC status is named here by its `grpc.StatusCode` member's name,
so this module needs no grpc: the gRPC face turns the name into the member
(faces/grpc/status_codes.py). The status details are the message alone, as Triton's are (a
client matching Triton's text finds it); tgw's code rides beside it: the trailing metadata
carries `tgw-code`, `tgw-retryable` and `tgw-details` (the error's details as JSON), and the
request's `traceparent` when it has one; over HTTP the body's "code" and the `tgw-code` header.
"""
from __future__ import annotations

import orjson

from tgw.shm.errors import Code, TgwError, fail

TRACEPARENT = "traceparent"   # a request's trace context: an HTTP header, gRPC metadata
CODE_HEADER = "tgw-code"      # tgw's error code: an HTTP error's header, a gRPC error's trailer

# code -> the name of its grpc.StatusCode
GRPC_STATUS: dict[Code, str] = {
    Code.INVALID_ARGUMENT: "INVALID_ARGUMENT",
    Code.INVALID_INPUT_SHAPE: "INVALID_ARGUMENT",
    Code.INVALID_INPUT_DTYPE: "INVALID_ARGUMENT",
    Code.PAYLOAD_TOO_LARGE: "RESOURCE_EXHAUSTED",
    Code.UNAUTHENTICATED: "UNAUTHENTICATED",
    Code.MODEL_NOT_FOUND: "NOT_FOUND",
    Code.VERSION_NOT_FOUND: "NOT_FOUND",
    Code.JOB_NOT_FOUND: "NOT_FOUND",
    Code.MODEL_NOT_READY: "UNAVAILABLE",
    Code.RATE_LIMITED: "RESOURCE_EXHAUSTED",
    Code.OVERLOADED: "RESOURCE_EXHAUSTED",
    Code.DEADLINE_EXCEEDED: "DEADLINE_EXCEEDED",
    Code.CIRCUIT_OPEN: "UNAVAILABLE",
    Code.OUT_OF_GPU_MEMORY: "RESOURCE_EXHAUSTED",
    Code.OUT_OF_SHM: "RESOURCE_EXHAUSTED",
    Code.WORKER_DIED: "UNAVAILABLE",
    Code.MODEL_EXECUTION_ERROR: "INTERNAL",
    Code.INTERNAL: "INTERNAL",
    Code.UNAVAILABLE: "UNAVAILABLE",
}


def bad(message: str, code: Code = Code.INVALID_ARGUMENT, **details) -> TgwError:
    """A request the protocol refuses (INVALID_ARGUMENT unless said), its field in `details`."""
    return fail(code, message, **details)


def refuse(message: str, reason: str, code: Code = Code.INVALID_ARGUMENT, **details) -> TgwError:
    """A refusal with a `reason` detail a caller can branch on (shared memory's, triton_shm.py)."""
    return fail(code, message, reason=reason, **details)


def error_body(err: TgwError) -> bytes:
    """Triton's error shape ({"error": message}) plus tgw's code, retryable flag and details."""
    return orjson.dumps({"error": err.message, "code": err.code.value, "retryable": err.retryable,
                         "details": err.details}, default=str)


def grpc_status(err: TgwError) -> str:
    """The name of the grpc.StatusCode the error is answered with."""
    return GRPC_STATUS.get(err.code, "INTERNAL")


def details(err: TgwError) -> str:
    """The gRPC status details: the message, as Triton words it (the code is in the trailers)."""
    return err.message


def trailers(err: TgwError, trace: str | None = None) -> tuple:
    """The gRPC trailing metadata an error adds: tgw's code, retryable flag and details."""
    out = [(CODE_HEADER, err.code.value), ("tgw-retryable", "true" if err.retryable else "false"),
           ("tgw-details", orjson.dumps(err.details, default=str).decode())]
    if trace:
        out.append((TRACEPARENT, trace))
    return tuple(out)
