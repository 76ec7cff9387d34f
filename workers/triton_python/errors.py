"""Triton's error types as a model.py uses them: `TritonError(message, code)` (set on an
InferenceResponse to fail only its request), its codes as class attributes, and
`TritonModelException` (raised: fails the whole execute call, as in Triton)."""
from __future__ import annotations


class TritonModelException(Exception):
    """Raised by a model (or by this module on a misuse): the whole batch of requests fails."""


class TritonError(Exception):
    """An error a response carries: `TritonError(message, code=TritonError.INTERNAL)`.

    Triton's is not an exception class; this one is, so a model that raises it gets its message
    in the batch's error instead of Python's "exceptions must derive from BaseException"."""

    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)
    _NAMES = ("UNKNOWN", "INTERNAL", "NOT_FOUND", "INVALID_ARG", "UNAVAILABLE", "UNSUPPORTED", "ALREADY_EXISTS",
              "CANCELLED")

    def __init__(self, message: str, code: int = 1):
        if message is None:
            raise TypeError("TritonError: message must be a str, not None")
        if isinstance(code, bool) or not isinstance(code, int) or not 0 <= code < len(self._NAMES):
            names = ", ".join(f"TritonError.{n}" for n in self._NAMES)
            raise TypeError(f"TritonError: code {code!r} is not one of {names}")
        super().__init__(message)
        self._message, self._code = str(message), code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code

    def code_name(self) -> str:
        return self._NAMES[self._code]

    def __str__(self) -> str:
        return self._message

    def __repr__(self) -> str:
        return f"TritonError({self._message!r}, TritonError.{self.code_name()})"
