"""Triton's shared-memory extensions on the HTTP face (docs/SHARED_MEMORY.md): the endpoints
tritonclient.http's *_shared_memory calls use, over the registry of protocol/triton_shm.py
(which also holds the infer path's part: CUDA regions routed, outputs written into regions).

Off unless `http.allow_client_shm`: every endpoint then answers Triton's "Client shared memory is
disabled" with its status, 501 (reason `client_shm_disabled`, tgw code INVALID_ARGUMENT:
protocol/errors.py), and so does a request that names a region (protocol/kserve.py). Not
UNAUTHENTICATED: no token would change the answer; not retryable: it is the broker's
configuration, not a passing state.
"""
from __future__ import annotations

import base64
import binascii
import os
import socket
import struct
from typing import Awaitable, Callable

import orjson
from aiohttp import web

from tgw.shm.errors import Code, fail

from tgw.broker.protocol.triton_shm import FRONT_PEER, Caller, TritonShm, front_peer_uid, tcp_peer_uid

from .answers import json_response

SYSTEM, CUDA = "/v2/systemsharedmemory", "/v2/cudasharedmemory"


def disabled():
    return fail(Code.INVALID_ARGUMENT, "Client shared memory is disabled. Set http.allow_client_shm: true in the "
                "broker's config to enable (docs/SHARED_MEMORY.md)", reason="client_shm_disabled")


def caller_of(request: web.Request, token: bool) -> Caller:
    """What the connection tells of who is at its other end: a Unix socket's SO_PEERCRED, or a
    TCP peer's socket owner on this host (tcp_peer_uid); `token`: the broker's was presented.
    On the Unix socket, a front process of the broker's own uid forwards for its client and
    tells who that is (FRONT_PEER; docs/FRONTS.md): its word is taken there, and only there."""
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    uid = None
    if sock is not None and sock.family == socket.AF_UNIX:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        uid = struct.unpack("3i", creds)[1]
        told = request.headers.get(FRONT_PEER)
        if told is not None and uid == os.geteuid():
            uid = front_peer_uid(told)
    elif transport is not None:
        peer, local = transport.get_extra_info("peername"), transport.get_extra_info("sockname")
        if peer and local:
            uid = tcp_peer_uid(peer[:2], local[:2])
    return Caller(uid, token)


class ShmRoutes:
    def __init__(self, shm: TritonShm | None, read: Callable[[web.Request], Awaitable[bytes]], token: bool):
        """`shm`: the registry, None when this face does not allow client shared memory;
        `read`: a request's body (the face's limits); `token`: the broker requires one."""
        self.shm, self.read, self.token = shm, read, token

    def routes(self) -> list[tuple[str, str, Callable]]:
        out = []
        for base, register, unregister, status in ((SYSTEM, self.register_system, self.shm_call("unregister_system"),
                                                    self.shm_call("system_status")),
                                                   (CUDA, self.register_cuda, self.shm_call("unregister_cuda"),
                                                    self.shm_call("cuda_status"))):
            out += [("POST", f"{base}/region/{{name}}/register", register),
                    ("GET", f"{base}/status", status), ("GET", f"{base}/region/{{name}}/status", status),
                    ("POST", f"{base}/unregister", unregister), ("POST", f"{base}/region/{{name}}/unregister", unregister)]
        return out

    def registry(self) -> TritonShm:
        if self.shm is None:
            raise disabled()
        return self.shm

    def shm_call(self, method: str):
        """A status or unregister endpoint: the registry's `method` for the path's region (all
        regions without one); status answers the list, unregister an empty 200, as Triton."""
        async def handler(request: web.Request) -> web.Response:
            answer = getattr(self.registry(), method)(request.match_info.get("name"))
            return json_response(answer) if method.endswith("status") else web.Response(status=200)
        return handler

    async def body(self, request: web.Request) -> dict:
        raw = await self.read(request)
        try:
            doc = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError as exc:
            raise fail(Code.INVALID_ARGUMENT, f"register body is not JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise fail(Code.INVALID_ARGUMENT, "a register body is a JSON object")
        return doc

    async def register_system(self, request: web.Request) -> web.Response:
        shm = self.registry()
        doc = await self.body(request)
        if "key" not in doc or "byte_size" not in doc:
            raise fail(Code.INVALID_ARGUMENT, "a system shared memory register body needs \"key\" and \"byte_size\" "
                       "(and \"offset\", default 0)", reason="shm_key")
        shm.register_system(request.match_info["name"], doc["key"], doc.get("offset", 0), doc["byte_size"],
                            caller_of(request, self.token))
        return web.Response(status=200)

    async def register_cuda(self, request: web.Request) -> web.Response:
        shm = self.registry()
        doc = await self.body(request)
        raw = doc.get("raw_handle")
        b64 = raw.get("b64") if isinstance(raw, dict) else None
        if not isinstance(b64, str) or "device_id" not in doc or "byte_size" not in doc:
            raise fail(Code.INVALID_ARGUMENT, "a CUDA shared memory register body needs \"raw_handle\": {\"b64\": "
                       "base64 of the cudaIpcMemHandle_t}, \"device_id\" and \"byte_size\"", reason="shm_cuda_handle")
        try:
            handle = base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError):
            raise fail(Code.INVALID_ARGUMENT, "raw_handle.b64 is not base64", reason="shm_cuda_handle") from None
        shm.register_cuda(request.match_info["name"], handle, doc["device_id"], doc["byte_size"],
                          caller_of(request, self.token))
        return web.Response(status=200)
