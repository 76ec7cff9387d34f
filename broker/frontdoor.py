"""Reading a client's message: the header decoded once, or the error that answers it.

A header that does not decode still gets a well-formed reply: its id and protocol version are
read leniently where possible, so a newer client learns of the version mismatch rather than of
a "malformed" header.
"""
from __future__ import annotations

from tgw.shm.errors import Code, TgwError, fail
from tgw.shm.wire import PROTOCOL_VERSION, DecodeError, envelope_decoder, request_decoder


class Refused(Exception):
    """The message cannot be served; `error` answers it under `req_id`."""

    def __init__(self, req_id: int, error: TgwError):
        super().__init__(error.message)
        self.req_id, self.error = req_id, error


def read_request(frames: list):
    """The decoded header of [identity, header, tensor frames...]; raises Refused."""
    if len(frames) < 2:
        raise Refused(0, fail(Code.INVALID_ARGUMENT, "empty message: a header frame is required"))
    header = frames[1].buffer
    try:
        msg = request_decoder.decode(header)
    except DecodeError as exc:
        raise _malformed(header, exc) from None
    if msg.v != PROTOCOL_VERSION:
        raise Refused(msg.id, _version_mismatch(msg.v))
    return msg


def _malformed(header, exc: Exception) -> Refused:
    try:
        env = envelope_decoder.decode(header)
    except DecodeError:
        env = None
    # `type(...) is int`: a bool is an int to isinstance, but not on the wire
    req_id = env.id if env is not None and type(env.id) is int else 0
    if env is not None and type(env.v) is int and env.v != PROTOCOL_VERSION:
        # a newer client's header may not fit our structs: name the real problem
        return Refused(req_id, _version_mismatch(env.v))
    return Refused(req_id, fail(Code.INVALID_ARGUMENT, f"malformed request header: {exc}"))


def _version_mismatch(version: int) -> TgwError:
    return fail(Code.INVALID_ARGUMENT, f"protocol version mismatch: client speaks {version}, broker speaks "
                f"{PROTOCOL_VERSION}", client_protocol=version, server_protocol=PROTOCOL_VERSION)
