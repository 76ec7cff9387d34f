"""What the HTTP face answers with: the caller that stands in for a socket identity, and its
JSON and error responses (apart from face.py, so its routes modules can use them)."""
from __future__ import annotations

import orjson
from aiohttp import web

from tgw.shm.errors import TgwError

from tgw.broker.protocol import kserve
from tgw.broker.protocol.door import AwaitedCaller
from tgw.broker.protocol.errors import TRACEPARENT, error_body, headers, http_status


class HttpCaller(AwaitedCaller):
    """One HTTP request's stand-in for a socket identity (protocol/door.py)."""
    __slots__ = ()
    face = "http"


def error_response(err: TgwError, trace: str | None = None) -> web.Response:
    extra = headers(err)   # tgw's code beside Triton's {"error": message}
    if trace:
        extra[TRACEPARENT] = trace
    return web.Response(status=http_status(err), body=error_body(err), content_type="application/json",
                        headers=extra)


def json_response(doc, status_code: int = 200) -> web.Response:
    return web.Response(status=status_code, body=orjson.dumps(doc), content_type="application/json")


def infer_response(request: web.Request, reply, frames: list, decoded: "kserve.Decoded",
                   placed: dict | None) -> web.Response:
    """An inference's answer: its JSON header, then its binary outputs (`placed`: those written
    into shared memory regions instead, by name); compressed when the caller accepts it."""
    header, blobs = kserve.encode(reply, frames, decoded.request_id, decoded.binary, placed)
    headers = {}
    if reply.traceparent:
        headers[TRACEPARENT] = reply.traceparent
    if blobs:
        headers[kserve.HEADER_LENGTH] = str(len(header))
        resp = web.Response(body=b"".join([header, *blobs]), headers=headers, content_type="application/octet-stream")
    else:
        resp = web.Response(body=header, headers=headers, content_type="application/json")
    accept = request.headers.get("Accept-Encoding")
    if accept and ("gzip" in accept or "deflate" in accept):
        resp.enable_compression()
    return resp
