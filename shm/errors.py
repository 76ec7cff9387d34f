"""The one table of error codes (DESIGN.md section 3) and the exception that carries them.

Errors cross process boundaries as data ({code, message, details, retryable}); each side turns
them back into the exception class registered for the code.
"""
from __future__ import annotations

from enum import Enum
from typing import Any


class Code(str, Enum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    INVALID_INPUT_SHAPE = "INVALID_INPUT_SHAPE"
    INVALID_INPUT_DTYPE = "INVALID_INPUT_DTYPE"
    PAYLOAD_TOO_LARGE = "PAYLOAD_TOO_LARGE"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    MODEL_NOT_FOUND = "MODEL_NOT_FOUND"
    VERSION_NOT_FOUND = "VERSION_NOT_FOUND"
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


# code -> (HTTP status, retryable)
ERROR_TABLE: dict[Code, tuple[int, bool]] = {
    Code.INVALID_ARGUMENT: (400, False),
    Code.INVALID_INPUT_SHAPE: (400, False),
    Code.INVALID_INPUT_DTYPE: (400, False),
    Code.PAYLOAD_TOO_LARGE: (413, False),
    Code.UNAUTHENTICATED: (401, False),
    Code.MODEL_NOT_FOUND: (404, False),
    Code.VERSION_NOT_FOUND: (404, False),
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
}


def http_status(code: Code | str) -> int:
    return ERROR_TABLE[Code(code)][0]


class TgwError(Exception):
    """Base of every tgw error; `code` is a `Code`, `details` a JSON-able dict."""

    code: Code = Code.INTERNAL

    def __init__(self, message: str, details: dict[str, Any] | None = None, *, code: Code | str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = Code(code)
        self.message = message
        self.details = details or {}

    @property
    def http_status(self) -> int:
        return ERROR_TABLE[self.code][0]

    @property
    def retryable(self) -> bool:
        return ERROR_TABLE[self.code][1]

    def __str__(self) -> str:
        return f"{self.code.value}: {self.message}"


def _class_name(code: Code) -> str:
    return "".join(part.capitalize() for part in code.value.split("_")) + "Error"


# One subclass per code, e.g. ModelNotFoundError, built from the table so nothing drifts.
ERROR_CLASSES: dict[Code, type[TgwError]] = {
    code: type(_class_name(code), (TgwError,), {"code": code, "__module__": __name__}) for code in Code
}
globals().update({cls.__name__: cls for cls in ERROR_CLASSES.values()})


def error_for(code: Code | str, message: str, details: dict[str, Any] | None = None) -> TgwError:
    """The exception instance for a code; an unknown code (a newer server) becomes INTERNAL."""
    try:
        cls = ERROR_CLASSES[Code(code)]
    except ValueError:
        return TgwError(message, {**(details or {}), "unknown_code": code})
    return cls(message, details)
