"""A TgwError as each face answers it: the refusal helpers, Triton's JSON error shape, and the
gRPC status and trailing metadata of each code, as data.

The HTTP status of each code is the wire contract's (tgw.shm.errors.ERROR_TABLE, which the
native client reads too); the gRPC status is named here by its `grpc.StatusCode` member's name,
so this module needs no grpc: the gRPC face turns the name into the member
(faces/grpc/status_codes.py). The message, the HTTP body's "error" and the gRPC status details,
is the error's own; tgw's code travels beside it: the body's "code", the `tgw-code` header and
trailing metadata (with `tgw-retryable` and `tgw-details`, the error's details as JSON), and the
request's `traceparent` when it has one.

Model-level errors are answered in Triton's words and status (`triton_answer`), which Triton's
clients and tests match: an unknown model or version, a malformed version, a model with no ready
version or a version not ready; tgw's own message is kept in the details (`tgw_message`).
"""
from __future__ import annotations

from typing import NamedTuple

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


class Answer(NamedTuple):
    """What the KServe faces answer an error with: the message, HTTP status, gRPC status name."""
    message: str
    http: int
    grpc: str


UNKNOWN = "Request for unknown model: "   # Triton core's prefix of every model lookup failure


def triton_answer(err: TgwError) -> Answer:
    """The error as Triton would word it (core's model_repository_manager.cc and
    model_lifecycle.cc, server's common.cc), or as tgw words it where Triton has no such error.
    A lookup error that carries a `reason` is tgw's own (a load's, a shadow's): left as it is."""
    d = err.details if isinstance(err.details, dict) else {}
    model, version, reason = d.get("model"), d.get("version"), d.get("reason")
    if reason == "client_shm_disabled":   # Triton: UNSUPPORTED, "Client shared memory is disabled. ..."
        return Answer(err.message, 501, "UNIMPLEMENTED")
    if not isinstance(model, str):
        return Answer(err.message, err.http_status, GRPC_STATUS.get(err.code, "INTERNAL"))
    if err.code is Code.MODEL_NOT_FOUND and reason is None:
        return Answer(f"{UNKNOWN}'{model}' is not found", 404, "NOT_FOUND")
    if err.code is Code.VERSION_NOT_FOUND and reason is None and isinstance(version, str):
        if version.isdecimal():
            return Answer(f"{UNKNOWN}'{model}' version {version} is not found", 404, "NOT_FOUND")
        if version.startswith("-") and version[1:].isdecimal():
            return Answer(f"invalid model version specified '{version}' , version should be an integral value > 0",
                          400, "INVALID_ARGUMENT")
        return Answer(f"failed to get model version from specified version string '{version}' (details: stol), "
                      "version should be an integral value > 0", 400, "INVALID_ARGUMENT")
    if err.code is Code.MODEL_NOT_READY:
        if reason == "no_version":   # Triton: NOT_FOUND, the latest version being none of the ready ones
            return Answer(f"{UNKNOWN}'{model}' has no available versions", 404, "NOT_FOUND")
        if reason is None and isinstance(version, str):
            return Answer(f"{UNKNOWN}'{model}' version {version} is not at ready state", 503, "UNAVAILABLE")
    return Answer(err.message, err.http_status, GRPC_STATUS.get(err.code, "INTERNAL"))


def bad(message: str, code: Code = Code.INVALID_ARGUMENT, **details) -> TgwError:
    """A request the protocol refuses (INVALID_ARGUMENT unless said), its field in `details`."""
    return fail(code, message, **details)


def refuse(message: str, reason: str, code: Code = Code.INVALID_ARGUMENT, **details) -> TgwError:
    """A refusal with a `reason` detail a caller can branch on (shared memory's, triton_shm.py)."""
    return fail(code, message, reason=reason, **details)


def error_body(err: TgwError) -> bytes:
    """Triton's error shape ({"error": message}) plus tgw's code, retryable flag and details."""
    return orjson.dumps({"error": triton_answer(err).message, "code": err.code.value, "retryable": err.retryable,
                         "details": kept_details(err)}, default=str)


def kept_details(err: TgwError) -> dict:
    """The error's details, with tgw's own message where Triton's words replace it."""
    message = triton_answer(err).message
    if message == err.message:
        return err.details
    return {**err.details, "tgw_message": err.message}


def http_status(err: TgwError) -> int:
    """The HTTP status a KServe face answers the error with (Triton's, for model-level errors)."""
    return triton_answer(err).http


def headers(err: TgwError) -> dict[str, str]:
    """tgw's code and retryable flag as HTTP headers, beside Triton's body."""
    return {CODE_HEADER: err.code.value, "tgw-retryable": "true" if err.retryable else "false"}


def grpc_status(err: TgwError) -> str:
    """The name of the grpc.StatusCode the error is answered with (Triton's, for model-level errors)."""
    return triton_answer(err).grpc


def details(err: TgwError) -> str:
    """The gRPC status details: the message alone, as Triton's (tgw's code is in the trailers)."""
    return triton_answer(err).message


def trailers(err: TgwError, trace: str | None = None) -> tuple:
    """The gRPC trailing metadata an error adds: tgw's code, retryable flag and details."""
    out = [(CODE_HEADER, err.code.value), ("tgw-retryable", "true" if err.retryable else "false"),
           ("tgw-details", orjson.dumps(kept_details(err), default=str).decode())]
    if trace:
        out.append((TRACEPARENT, trace))
    return tuple(out)
