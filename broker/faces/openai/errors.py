"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with OpenAI's HTTP
statuses, made from tgw's error codes (tgw.shm.errors), so the openai client raises the class its
users catch (BadRequestError, AuthenticationError, NotFoundError, RateLimitError, ...)."""
from __future__ import annotations

import orjson
from aiohttp import web

from tgw.shm.errors import Code, TgwError

# tgw's code -> (HTTP status, OpenAI's error type); the rest are 500 server_error
_KINDS = {
    Code.INVALID_ARGUMENT: (400, "invalid_request_error"),
    Code.INVALID_INPUT_SHAPE: (400, "invalid_request_error"),
    Code.INVALID_INPUT_DTYPE: (400, "invalid_request_error"),
    Code.PAYLOAD_TOO_LARGE: (413, "invalid_request_error"),
    Code.UNAUTHENTICATED: (401, "authentication_error"),
    Code.MODEL_NOT_FOUND: (404, "invalid_request_error"),
    Code.VERSION_NOT_FOUND: (404, "invalid_request_error"),
    Code.RATE_LIMITED: (429, "rate_limit_error"),
    Code.OVERLOADED: (429, "rate_limit_error"),
    Code.DEADLINE_EXCEEDED: (504, "server_error"),
    Code.MODEL_NOT_READY: (503, "server_error"),
    Code.CIRCUIT_OPEN: (503, "server_error"),
    Code.UNAVAILABLE: (503, "server_error"),
}
_CODES = {Code.MODEL_NOT_FOUND: "model_not_found", Code.UNAUTHENTICATED: "invalid_api_key",
          Code.RATE_LIMITED: "rate_limit_exceeded", Code.OVERLOADED: "rate_limit_exceeded"}


class OpenAiError(Exception):
    """A refusal in OpenAI's words: status, type, the parameter at fault, a short code."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type_, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.Response(status=self.status, body=orjson.dumps(self.body()), content_type="application/json")


def invalid(message: str, param: str | None, code: str | None = None) -> OpenAiError:
    return OpenAiError(message, param, 400, "invalid_request_error", code)


def from_tgw(err: TgwError) -> OpenAiError:
    """tgw's error as OpenAI's: the same message (tgw's code in front, for the logs), its status."""
    status, type_ = _KINDS.get(err.code, (500, "server_error"))
    param = err.details.get("parameter") if isinstance(err.details, dict) else None
    code = _CODES.get(err.code, err.code.value.lower())
    return OpenAiError(f"[{err.code.value}] {err.message}", param, status, type_, code)
