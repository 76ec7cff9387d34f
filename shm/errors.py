"""The one table of error codes (docs/ARCHITECTURE.md, "The wire contract") and the exception that carries them.

Errors cross process boundaries as data ({code, message, details, retryable}): one way in
(`fail`), one way onto the wire (`TgwError.to_body`), one way back (`error_from_body`).
"""
from __future__ import annotations

from enum import Enum
from typing import Any

from .wire import ErrorBody


class Code(str, Enum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    INVALID_INPUT_SHAPE = "INVALID_INPUT_SHAPE"
    INVALID_INPUT_DTYPE = "INVALID_INPUT_DTYPE"
    PAYLOAD_TOO_LARGE = "PAYLOAD_TOO_LARGE"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    MODEL_NOT_FOUND = "MODEL_NOT_FOUND"
    VERSION_NOT_FOUND = "VERSION_NOT_FOUND"
    JOB_NOT_FOUND = "JOB_NOT_FOUND"          # a polled job's id: unknown, expired, or from an earlier broker run
    MODEL_NOT_READY = "MODEL_NOT_READY"
    RATE_LIMITED = "RATE_LIMITED"
    OVERLOADED = "OVERLOADED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    CIRCUIT_OPEN = "CIRCUIT_OPEN"
    OUT_OF_GPU_MEMORY = "OUT_OF_GPU_MEMORY"
    OUT_OF_SHM = "OUT_OF_SHM"
    WORKER_DIED = "WORKER_DIED"
    MODEL_EXECUTION_ERROR = "MODEL_EXECUTION_ERROR"
    INTERNAL = "INTERNAL"
    # raised by the client only: the connection to the broker was lost (the broker died, restarted
    # or stopped answering heartbeats) or none came up in time; a request may or may not have run
    UNAVAILABLE = "UNAVAILABLE"


# code -> (HTTP status, retryable)
ERROR_TABLE: dict[Code, tuple[int, bool]] = {
    Code.INVALID_ARGUMENT: (400, False),
    Code.INVALID_INPUT_SHAPE: (400, False),
    Code.INVALID_INPUT_DTYPE: (400, False),
    Code.PAYLOAD_TOO_LARGE: (413, False),
    Code.UNAUTHENTICATED: (401, False),
    Code.MODEL_NOT_FOUND: (404, False),
    Code.VERSION_NOT_FOUND: (404, False),
    Code.JOB_NOT_FOUND: (404, False),
    Code.MODEL_NOT_READY: (503, True),
    Code.RATE_LIMITED: (429, True),
    Code.OVERLOADED: (429, True),
    Code.DEADLINE_EXCEEDED: (504, False),
    Code.CIRCUIT_OPEN: (503, True),
    Code.OUT_OF_GPU_MEMORY: (507, True),
    Code.OUT_OF_SHM: (507, True),
    Code.WORKER_DIED: (503, True),
    Code.MODEL_EXECUTION_ERROR: (500, False),
    Code.INTERNAL: (500, False),
    Code.UNAVAILABLE: (503, True),
}


def http_status(code: Code | str) -> int:
    return ERROR_TABLE[Code(code)][0]


class TgwError(Exception):
    """Base of every tgw error; `code` is a `Code`, `details` a JSON-able dict."""

    code: Code = Code.INTERNAL

    def __init__(self, message: str, details: dict[str, Any] | None = None, retryable: bool | None = None):
        super().__init__(message)
        self.message = message
        self.details = details or {}
        self._retryable = retryable  # None: the code's default (ERROR_TABLE)

    @property
    def http_status(self) -> int:
        return ERROR_TABLE[self.code][0]

    @property
    def retryable(self) -> bool:
        """Whether the same request may succeed later; a code's default, unless this error knows
        better (e.g. OUT_OF_SHM for a request that can never fit)."""
        return ERROR_TABLE[self.code][1] if self._retryable is None else self._retryable

    def __str__(self) -> str:
        return f"{self.code.value}: {self.message}"

    def to_body(self) -> ErrorBody:
        """The error as data, to cross a socket (docs/ARCHITECTURE.md, "The wire contract")."""
        return ErrorBody(code=self.code.value, message=self.message, retryable=self.retryable,
                         details=self.details)


# One subclass per code, written out so they can be found by grep and IDEs;
# tests/unit/test_wire.py checks they match the table one to one.


class InvalidArgumentError(TgwError):
    code = Code.INVALID_ARGUMENT


class InvalidInputShapeError(TgwError):
    code = Code.INVALID_INPUT_SHAPE


class InvalidInputDtypeError(TgwError):
    code = Code.INVALID_INPUT_DTYPE


class PayloadTooLargeError(TgwError):
    code = Code.PAYLOAD_TOO_LARGE


class UnauthenticatedError(TgwError):
    code = Code.UNAUTHENTICATED


class ModelNotFoundError(TgwError):
    code = Code.MODEL_NOT_FOUND


class VersionNotFoundError(TgwError):
    code = Code.VERSION_NOT_FOUND


class JobNotFoundError(TgwError):
    code = Code.JOB_NOT_FOUND


class ModelNotReadyError(TgwError):
    code = Code.MODEL_NOT_READY


class RateLimitedError(TgwError):
    code = Code.RATE_LIMITED


class OverloadedError(TgwError):
    code = Code.OVERLOADED


class DeadlineExceededError(TgwError):
    code = Code.DEADLINE_EXCEEDED


class CircuitOpenError(TgwError):
    code = Code.CIRCUIT_OPEN


class OutOfGpuMemoryError(TgwError):
    code = Code.OUT_OF_GPU_MEMORY


class OutOfShmError(TgwError):
    code = Code.OUT_OF_SHM


class WorkerDiedError(TgwError):
    code = Code.WORKER_DIED


class ModelExecutionError(TgwError):
    code = Code.MODEL_EXECUTION_ERROR


ModelExecutionErrorError = ModelExecutionError   # its old name (the code ends in ERROR: "Error" came twice), kept


class InternalError(TgwError):
    code = Code.INTERNAL


class UnavailableError(TgwError):
    code = Code.UNAVAILABLE


ERROR_CLASSES: dict[Code, type[TgwError]] = {cls.code: cls for cls in TgwError.__subclasses__()}


def fail(code: Code | str, message: str, *, retryable: bool | None = None, **details: Any) -> TgwError:
    """The exception for `code`, e.g. `raise fail(Code.OVERLOADED, "queue full", max_queue=8)`."""
    return ERROR_CLASSES[Code(code)](message, details, retryable)


def error_from_body(body: ErrorBody) -> TgwError:
    """The exception an error that crossed a socket stands for; an unknown code (a newer peer)
    becomes INTERNAL with the code kept in its details."""
    try:
        cls = ERROR_CLASSES[Code(body.code)]
    except ValueError:
        return TgwError(body.message, {**body.details, "unknown_code": body.code})
    return cls(body.message, dict(body.details), body.retryable)
