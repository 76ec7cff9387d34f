"""What a front forwards of HTTP: every route it does not serve itself, to the broker's own HTTP face
on its private Unix socket, and the answer back as it comes.

A request goes on as the client sent it: method, raw path and query, headers (only the hop-by-hop
ones dropped, RFC 9110 7.6.1) and body, streamed when the front has not read it; the answer comes
back the same way, status, reason, headers and body chunks as the broker writes them (an SSE
event reaches the client when the broker writes it), never decompressed nor re-encoded. One
long-lived client session holds the connections (no pool limit, no cookie jar, no timeouts: a
long poll or a stream lasts as long as the broker keeps it). A client that goes cancels the
forwarded request, whose connection is closed, so the broker's face sees its client go as it would
without a front. The broker's face reads who the peer is in one place (registering client shared
memory: the peer's uid); the front's view of its peer travels in PEER_HEADER, which the front
always sets (a client's own value is dropped) and the broker trusts only on its Unix socket
(protocol/triton_shm.py front_peer_uid).
"""
from __future__ import annotations

import asyncio
import socket
import struct

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from tgw.broker.protocol.triton_shm import FRONT_PEER

PEER_HEADER = FRONT_PEER   # "tcp HOST PORT LOCAL_HOST LOCAL_PORT", "uid N" or "none"
# hop-by-hop: they describe one connection, not the request; Expect is answered by the front
HOP_BY_HOP = frozenset(h.lower() for h in ("Connection", "Keep-Alive", "Transfer-Encoding", "TE", "Trailer",
                                           "Upgrade", "Proxy-Authenticate", "Proxy-Authorization",
                                           "Proxy-Connection", "Expect", PEER_HEADER))
# what aiohttp's server decodes of a request body (its auto_decompress); the body forwarded is then
# the decoded one, so its Content-Encoding and Content-Length no longer describe it
DECODED = frozenset(("gzip", "deflate", "br", "zstd", "x-gzip"))
# aiohttp's client adds these when absent; a forwarded request carries only what the client sent
NOT_ADDED = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")
WHOLE_BYTES = 1 << 16    # an answer this small with a Content-Length is read whole and sent in one write


def unavailable(message: str) -> web.Response:
    """tgw's JSON error shape (broker/faces/http/answers.py) for a broker the front cannot reach."""
    return web.Response(status=503, body=orjson.dumps({"error": message, "code": "UNAVAILABLE"}),
                        content_type="application/json", headers={"tgw-code": "UNAVAILABLE"})


def peer_of(request: web.Request) -> str:
    """The front's view of who is at the other end of the request's connection (PEER_HEADER)."""
    transport = request.transport
    if transport is None:
        return "none"
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family == socket.AF_UNIX:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return f"uid {struct.unpack('3i', creds)[1]}"
    peer, local = transport.get_extra_info("peername"), transport.get_extra_info("sockname")
    if peer and local:
        return f"tcp {peer[0]} {peer[1]} {local[0]} {local[1]}"
    return "none"


def forwarded_headers(headers, decoded: bool) -> CIMultiDict:
    """`headers` less the hop-by-hop ones and those the Connection header names; `decoded`: the
    body was decoded on the way in, so its encoding and length go too."""
    named = headers.get("Connection")
    drop = HOP_BY_HOP | {t.strip().lower() for t in named.split(",")} if named else HOP_BY_HOP
    if decoded:
        drop = drop | {"content-encoding", "content-length"}
    out = CIMultiDict()
    for key, value in headers.items():
        if key.lower() not in drop:
            out.add(key, value)
    return out


class HttpForwarder:
    def __init__(self, unix_path: str, decompressed: bool = True):
        """`unix_path`: where the broker's own HTTP face listens; `decompressed`: the front's server
        decodes request bodies (aiohttp's default, auto_decompress=True)."""
        self.unix_path, self.decompressed = unix_path, decompressed
        self.session: aiohttp.ClientSession | None = None   # made on first use, on the serving loop
        self.forwarded = 0           # requests forwarded in this life
        self.failed = 0              # of which the broker could not be reached or broke off

    def client(self) -> aiohttp.ClientSession:
        if self.session is None:
            connector = aiohttp.UnixConnector(path=self.unix_path, limit=0)
            self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                                 cookie_jar=aiohttp.DummyCookieJar(),
                                                 timeout=aiohttp.ClientTimeout(total=None),
                                                 skip_auto_headers=NOT_ADDED, read_bufsize=1 << 20)
        return self.session

    async def handle(self, request: web.Request, body: bytes | None = None) -> web.StreamResponse:
        """Forward `request` (`body`: the front read it already) and answer what the broker answers."""
        self.forwarded += 1
        encoding = request.headers.get("Content-Encoding")
        decoded = self.decompressed and encoding is not None and encoding.strip().lower() in DECODED
        headers = forwarded_headers(request.headers, decoded or body is not None)
        headers[PEER_HEADER] = peer_of(request)
        if body is not None:
            data = body
        elif not request.body_exists:
            data = None
        elif request.content.is_eof():   # it all came with the headers: one write on
            data = request.content.read_nowait()
        else:
            data = request.content       # streamed as it arrives
        url = URL("http://broker" + request.raw_path, encoded=True)
        try:
            upstream = await self.client().request(request.method, url, headers=headers, data=data,
                                                   allow_redirects=False)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as exc:
            self.failed += 1
            return unavailable(f"the broker's HTTP face cannot be reached from this front ({self.unix_path}): "
                               f"{type(exc).__name__}: {exc}")
        try:
            return await self.answer(request, upstream)
        finally:
            upstream.close()   # read to its end: the connection goes back to the pool; else it closes

    async def answer(self, request: web.Request, upstream: aiohttp.ClientResponse) -> web.StreamResponse:
        headers = forwarded_headers(upstream.headers, False)
        length = upstream.content_length
        if length is not None and length <= WHOLE_BYTES and request.method != "HEAD":
            try:
                data = await upstream.read()
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
                self.failed += 1
                return unavailable(f"the broker's HTTP face broke off its answer: {type(exc).__name__}: {exc}")
            resp = web.Response(status=upstream.status, reason=upstream.reason, body=data, headers=headers)
        else:
            resp = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)
            if upstream.headers.get("Connection", "").lower() == "close":
                resp.force_close()
            await resp.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await resp.write(chunk)
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError):
                # the status is sent: the client must see a broken answer, not a short whole one
                self.failed += 1
                if request.transport is not None:
                    request.transport.close()
                return resp
            await resp.write_eof()
            return resp
        if upstream.headers.get("Connection", "").lower() == "close":   # the broker's drain notice
            resp.force_close()
        return resp

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None
