"""The repository extension's HTTP endpoints (index, load, unload): a JSON body parsed here, the
answer made by protocol/repository.py (the gRPC face calls the same methods)."""
from __future__ import annotations

from typing import Awaitable, Callable

import orjson
from aiohttp import web

from tgw.shm.errors import Code, fail

from tgw.broker.protocol.kserve import mapping
from tgw.broker.protocol.repository import Repository

from .answers import json_response


class RepositoryRoutes:
    def __init__(self, repository: Repository, read: Callable[[web.Request], Awaitable[bytes]]):
        """`read`: a request's body (the face's limits)."""
        self.repository, self.read = repository, read

    async def index(self, request: web.Request) -> web.Response:
        return json_response(self.repository.index_rows((await self.body(request)).get("ready", False) is True))

    async def load(self, request: web.Request) -> web.Response:
        self.repository.control_allowed()   # before the body is read
        doc = await self.body(request)
        message = await self.repository.load_model(request.match_info["model"],
                                                   mapping(doc.get("parameters"), "parameters"))
        return json_response({"message": message})

    async def unload(self, request: web.Request) -> web.Response:
        self.repository.control_allowed()
        doc = await self.body(request)
        message = await self.repository.unload_model(request.match_info["model"],
                                                     mapping(doc.get("parameters"), "parameters"))
        return json_response({"message": message})

    async def body(self, request: web.Request) -> dict:
        raw = await self.read(request)
        if not raw:
            return {}
        try:
            doc = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise fail(Code.INVALID_ARGUMENT, f"request body is not JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise fail(Code.INVALID_ARGUMENT, "request body must be a JSON object")
        return doc
