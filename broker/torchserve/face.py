"""TorchServe's inference and management APIs, on their own two ports, over tgw's front door.

Inference (`torchserve.inference_port`, TorchServe's 8080): `GET /ping`, `POST|PUT
/predictions/{model}[/{version}]` with a raw body (the handler gets it as "body") or a
multipart/url-encoded form (each field by its name). Management (`management_port`, 8081): `GET
/models` (paged: limit, next_page_token), `GET /models/{m}[/{v}|/all]`, `POST /models?url=FILE`
(register an archive of the model store), `DELETE /models/{m}[/{v}]`, `PUT
/models/{m}/{v}/set-default`. Answers and errors are TorchServe's: its status codes, and errors
as {"code", "type", "message"} with its texts. With server.auth_token_file both ports want
`Authorization: Bearer TOKEN` (TorchServe's token authorization), /ping excepted.

A request is one row of the archive's stage (archive.py): the face packs TorchServe's request
(its parameters and headers) into the stage's one bytes input and unpacks the handler's answer
(workers/torchserve_handler.py).
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import uuid
from itertools import count

import msgspec
import orjson
from aiohttp import web

from tgw.shm.bytes_tensor import pack, unpack
from tgw.shm.errors import Code, TgwError, error_from_body
from tgw.shm.wire import PROTOCOL_VERSION, ErrorReply, Infer, TensorMeta

from tgw.broker.config.load import TorchServeDecl
from tgw.broker.config.startup import StartupError
from tgw.broker.front.regions import SliceFrame
from tgw.broker.models.operator import Operator
from tgw.broker.protocol.door import AwaitedCaller, DoorPort
from tgw.broker.state.versions import VersionState

from .archive import ArchiveError, Registration
from .store import ModelStore, Served, served_at_start

log = logging.getLogger("tgw.broker")
_encode = msgspec.msgpack.Encoder()
_decode = msgspec.msgpack.Decoder()
TOKEN_REFUSED = "Token Authorization failed. Token either incorrect, expired, or not provided correctly"
STATUS_TYPES = {400: "BadRequestException", 404: "ResourceNotFoundException", 405: "MethodNotAllowedException",
                408: "RequestTimeoutException", 409: "ConflictStatusException", 413: "BadRequestException",
                429: "ServiceUnavailableException", 503: "ServiceUnavailableException"}


class TsError(Exception):
    """An answer in TorchServe's error shape."""

    def __init__(self, code: int, kind: str, message: str):
        super().__init__(message)
        self.code, self.kind, self.message = code, kind, message

    def response(self) -> web.Response:
        return ts_json({"code": self.code, "type": self.kind, "message": self.message}, self.code)


def ts_json(doc, status: int = 200) -> web.Response:
    # TorchServe answers pretty-printed JSON (GSON's); clients parse it
    return web.Response(status=status, body=orjson.dumps(doc, option=orjson.OPT_INDENT_2),
                        content_type="application/json")


def not_found(model: str) -> TsError:
    return TsError(404, "ModelNotFoundException", f"Model not found: {model}")


def version_not_found(model: str, version: str) -> TsError:
    return TsError(404, "ModelVersionNotFoundException", f"Model version: {version} does not exist for model: {model}")


def from_tgw(err: TgwError, model: str) -> TsError:
    """A refusal or failure of tgw's answered in TorchServe's shape."""
    if err.code is Code.MODEL_NOT_FOUND:
        return not_found(model)
    if err.code is Code.VERSION_NOT_FOUND:
        return version_not_found(model, str(err.details.get("version", "")))
    if err.code in (Code.MODEL_EXECUTION_ERROR, Code.WORKER_DIED):
        return TsError(503, "InternalServerException", "Prediction failed")
    status = err.http_status
    return TsError(status, STATUS_TYPES.get(status, "InternalServerException"), err.message)


class TsCaller(AwaitedCaller):
    __slots__ = ()
    face = "torchserve"


class TorchServeFace:
    def __init__(self, port: DoorPort, decl: TorchServeDecl, store: ModelStore | None, operator: Operator,
                 catalog: dict[str, dict[str, Served]]):
        """`catalog`: the archives served at start (store.served_at_start); this face alone writes it."""
        self.port, self.decl, self.store, self.operator = port, decl, store, operator
        self.catalog = catalog
        self.ids = count(1)
        self.runners: list[web.AppRunner] = []
        self.address = ""

    # ---- the two apps ------------------------------------------------------------------------

    def inference_app(self) -> web.Application:
        app = web.Application(client_max_size=self.decl.max_body_bytes)
        add = app.router.add_route
        add("GET", "/ping", self.guarded(self.ping, open_path=True))
        for path in ("/predictions/{model}", "/predictions/{model}/{version}"):
            for method in ("POST", "PUT"):
                add(method, path, self.guarded(self.predict))
        add("*", "/{anything:.*}", self.guarded(self.nowhere, open_path=True))
        return app

    def management_app(self) -> web.Application:
        app = web.Application()
        add = app.router.add_route
        add("GET", "/models", self.guarded(self.list_models))
        add("POST", "/models", self.guarded(self.register))
        for path in ("/models/{model}", "/models/{model}/{version}"):
            add("GET", path, self.guarded(self.describe))
            add("DELETE", path, self.guarded(self.unregister))
        add("PUT", "/models/{model}/{version}/set-default", self.guarded(self.set_default))
        add("*", "/{anything:.*}", self.guarded(self.nowhere, open_path=True))
        return app

    async def start(self) -> str:
        addresses = []
        for app, port in ((self.inference_app(), self.decl.inference_port),
                          (self.management_app(), self.decl.management_port)):
            runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=5.0,
                                   handler_cancellation=True)
            await runner.setup()
            self.runners.append(runner)
            site = web.TCPSite(runner, self.decl.host, port, backlog=1024, reuse_address=True)
            try:
                await site.start()
            except OSError as exc:
                await self.stop()
                raise StartupError(f"torchserve face: cannot listen on {self.decl.host}:{port}: "
                                   f"{exc.strerror or exc}") from None
            host, bound = site._server.sockets[0].getsockname()[:2]
            addresses.append(f"http://{host}:{bound}")
        self.address = " ".join(addresses)   # inference, then management
        log.info("TorchServe face: inference on %s, management on %s", *addresses)
        return self.address

    async def stop(self) -> None:
        for runner in self.runners:
            await runner.cleanup()
        self.runners = []

    def guarded(self, handler, open_path: bool = False):
        async def guarded(request: web.Request) -> web.Response:
            try:
                if self.port.token and not open_path:
                    given = request.headers.get("Authorization", "")
                    if not (given.startswith("Bearer ") and
                            hmac.compare_digest(given[7:].strip().encode(), self.port.token.encode())):
                        raise TsError(400, "InvalidKeyException", TOKEN_REFUSED)
                return await handler(request)
            except TsError as err:
                return err.response()
            except TgwError as err:
                return from_tgw(err, request.match_info.get("model", "")).response()
            except web.HTTPException as exc:   # aiohttp's own refusals: a body over max_body_bytes (413)
                return TsError(exc.status, STATUS_TYPES.get(exc.status, "InternalServerException"),
                               exc.text or exc.reason).response()
            except Exception as exc:  # a broker bug: answered, logged with its stack
                self.port.note("broker_error", type(exc).__name__, f"TorchServe {request.method} {request.path} "
                               "failed inside the broker", exc_info=True)
                return TsError(500, "InternalServerException", f"{type(exc).__name__}: {exc}").response()
        return guarded

    async def nowhere(self, request: web.Request) -> web.Response:
        if request.path.rstrip("/") in ("/ping", "/predictions", "/models") or request.path.startswith(
                ("/predictions/", "/models/")):
            raise TsError(405, "MethodNotAllowedException",
                          "Requested method is not allowed, please refer to API document.")
        raise TsError(404, "ResourceNotFoundException", "Requested resource is not found, please refer to API document.")

    # ---- inference ---------------------------------------------------------------------------

    async def ping(self, request: web.Request) -> web.Response:
        healthy = self.port.view.is_serving()
        return ts_json({"status": "Healthy" if healthy else "Unhealthy"}, 200 if healthy else 500)

    async def predict(self, request: web.Request) -> web.Response:
        model, version = request.match_info["model"], request.match_info.get("version")
        versions = self.catalog.get(model)
        if versions is None:
            raise not_found(model)
        if version is not None and version not in versions:
            raise version_not_found(model, version)
        params = await self.params(request)
        headers = [[str(k), v] for k, v in request.headers.items()] + [["url_path", ""], ["explain", "False"]]
        payload = _encode.encode({"params": params, "headers": headers, "id": str(uuid.uuid4())})
        msg = Infer(v=PROTOCOL_VERSION, id=next(self.ids), model=model, version=version,
                    inputs=[TensorMeta(name="request", dtype="bytes", shape=[1])])
        caller = TsCaller(asyncio.get_running_loop())
        self.port.infer(caller, msg, [SliceFrame(memoryview(pack([payload])))])
        try:
            reply, frames = await caller.future
        except asyncio.CancelledError:   # the client closed its connection: nobody waits for it
            self.port.withdraw(caller, "client_closed")
            raise
        if isinstance(reply, ErrorReply):
            raise from_tgw(error_from_body(reply.error), model)
        answer = _decode.decode(unpack(frames[0], 1)[0])
        if "error" in answer:
            raise TsError(answer["status"], "InternalServerException", answer["error"])
        headers = answer["headers"]
        resp = web.Response(status=answer["status"], reason=answer["phrase"] or None, body=answer["body"])
        for key, value in headers.items():
            resp.headers[key] = value
        return resp

    async def params(self, request: web.Request) -> list:
        """TorchServe's request parameters: each form field by name (a file with its content
        type), else the whole body as "body" with the request's content type."""
        ctype = request.content_type   # the mime type alone, as TorchServe's HttpUtil.getMimeType
        if ctype.startswith("multipart/"):
            params = []
            try:
                reader = await request.multipart()
                async for part in reader:
                    data = await part.read()
                    params.append([part.name or "", part.headers.get("Content-Type", "") if part.filename else "",
                                   bytes(data)])
            except ValueError as exc:
                raise TsError(400, "BadRequestException", f"malformed multipart body: {exc}") from None
            return params
        if ctype == "application/x-www-form-urlencoded":
            form = await request.post()
            return [[k, "", v.encode() if isinstance(v, str) else v.file.read()] for k, v in form.items()]
        return [["body", ctype if request.headers.get("Content-Type") else "", await request.read()]]

    # ---- management --------------------------------------------------------------------------

    async def list_models(self, request: web.Request) -> web.Response:
        limit = int_param(request, "limit", 100)
        token = int_param(request, "next_page_token", 0)
        limit = 100 if limit > 100 or limit < 0 else limit
        token = max(token, 0)
        names = sorted(self.catalog)
        last = min(token + limit, len(names))
        doc: dict = {}
        if token + limit <= len(names):   # as TorchServe: a token whenever the page is full
            doc["nextPageToken"] = str(token + limit)
        doc["models"] = [{"modelName": n, "modelUrl": self.catalog[n][self.default(n)].url} for n in names[token:last]]
        return ts_json(doc)

    def default(self, model: str) -> str:
        entry = self.port.view.models.get(model)
        versions = self.catalog[model]
        return entry.default if entry is not None and entry.default in versions else next(iter(versions))

    async def describe(self, request: web.Request) -> web.Response:
        model, version = request.match_info["model"], request.match_info.get("version")
        versions = self.catalog.get(model)
        if versions is None:
            raise not_found(model)
        if version == "all":
            shown = list(versions)
        elif version is None:
            shown = [self.default(model)]
        elif version not in versions:
            raise version_not_found(model, version)
        else:
            shown = [version]
        return ts_json([self.description(model, v) for v in shown])

    def description(self, model: str, version: str) -> dict:
        s = self.catalog[model][version]
        entry = self.port.view.models.get(model)
        rec = entry.records.get(version) if entry is not None else None
        ready = rec is not None and rec.state is VersionState.READY
        holders = [w for w in self.port.view.roster if f"{model}:{version}" in w.models] if ready else []
        return {"modelName": model, "modelVersion": version, "modelUrl": s.url, "runtime": "python",
                "minWorkers": s.workers, "maxWorkers": s.workers, "batchSize": s.batch_size,
                "maxBatchDelay": s.max_batch_delay, "responseTimeout": s.response_timeout,
                "loadedAtStartup": s.startup, "status": "Healthy" if ready else "Unhealthy",
                "workers": [{"id": w.name, "status": "READY", "pid": w.pid, "gpu": w.device != "cpu",
                             "memoryUsage": 0} for w in holders]}

    async def register(self, request: web.Request) -> web.Response:
        q = request.query
        url = q.get("url")
        if not url:
            raise TsError(400, "BadRequestException", "Parameter url is required.")
        if self.store is None:
            raise TsError(400, "BadRequestException", "this broker has no model store (model_store, --model-store)")
        for refused in ("handler", "runtime", "s3_sse_kms"):
            if q.get(refused):
                raise TsError(400, "BadRequestException", f"parameter {refused}: tgw serves the archive's own "
                              f"{refused if refused != 's3_sse_kms' else 'file'}; leave it out")
        reg = Registration(batch_size=int_param(request, "batch_size", 0) or None,
                           max_batch_delay_ms=int_param(request, "max_batch_delay", -1) if "max_batch_delay" in q
                           else None,
                           initial_workers=int_param(request, "initial_workers", 0) or None,
                           response_timeout_s=int_param(request, "response_timeout", 0) or None,
                           model_name=q.get("model_name") or None)
        loop = asyncio.get_running_loop()
        try:   # unpacking a large archive takes a while: off the loop
            archive, decl = await loop.run_in_executor(None, self.store.decl, url, reg, self.decl.device)
        except ArchiveError as exc:
            status = 404 if str(exc).startswith("Model file not found") else 400
            raise TsError(status, "ModelNotFoundException" if status == 404 else "BadRequestException",
                          str(exc)) from None
        except ValueError as exc:
            raise TsError(400, "BadRequestException", f"{url}: {exc}") from None
        version = decl.versions[-1].version
        if version in self.catalog.get(decl.name, {}):
            raise TsError(409, "ConflictStatusException",
                          f"Model version {version} is already registered for model {decl.name}")
        entry = self.port.view.models.get(decl.name)
        if entry is not None and decl.name not in self.catalog:
            raise TsError(409, "ConflictStatusException", f"{decl.name} is a model of tgw's config, not an archive's")
        if entry is not None:   # a new version keeps the model's batching
            decl = entry.decl.model_copy(update={"versions": decl.versions})
        try:
            await self.operator.exclusive(lambda: self.operator.adoption.add(decl, self.store.unpack_dir))
        except TgwError as err:
            if err.details.get("reason") == "exists":   # registered meanwhile, by another request
                raise TsError(409, "ConflictStatusException", err.message) from None
            raise TsError(500, "InternalServerException",
                          f"Failed to start workers for model {decl.name} version: {version}: {err.message}") from None
        opts = decl.options.get("torchserve", {})
        self.catalog.setdefault(decl.name, {})[version] = Served(
            url=url, batch_size=decl.max_batch_size, max_batch_delay=opts.get("max_batch_delay", 0),
            response_timeout=decl.timeout_ms // 1000, workers=1, startup=False)
        workers = sum(1 for w in self.port.view.roster if f"{decl.name}:{version}" in w.models) or 1
        return ts_json({"status": f"Model \"{decl.name}\" Version: {version} registered with {workers} initial "
                                  "workers"})

    async def unregister(self, request: web.Request) -> web.Response:
        model, version = request.match_info["model"], request.match_info.get("version")
        versions = self.catalog.get(model)
        if versions is None:
            raise not_found(model)
        default = self.default(model)
        version = version or default
        if version not in versions:
            raise version_not_found(model, version)
        if version == default and len(versions) > 1:
            raise TsError(403, "InvalidModelVersionException", f"Cannot remove default version for model {model}")
        await self.operator.exclusive(lambda: self.operator.adoption.remove(model, version))
        del versions[version]
        if not versions:
            del self.catalog[model]
        return ts_json({"status": f"Model \"{model}\" unregistered"})

    async def set_default(self, request: web.Request) -> web.Response:
        model, version = request.match_info["model"], request.match_info["version"]
        versions = self.catalog.get(model)
        if versions is None:
            raise not_found(model)
        if version not in versions:
            raise TsError(404, "ModelVersionNotFoundException",
                          f"Model version {version} does not exist for model {model}")

        async def flip():
            self.operator.adoption.set_default(model, version)
        await self.operator.exclusive(flip)
        return ts_json({"status": f"Default version successfully updated for model \"{model}\" to \"{version}\""})


def int_param(request: web.Request, name: str, default: int) -> int:
    value = request.query.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise TsError(400, "BadRequestException", f"parameter {name} must be a whole number, got {value!r}") from None


def face_for(cfg, port: DoorPort, operator: Operator) -> TorchServeFace | None:
    """The TorchServe face when configured (torchserve:, or a model_store), not yet listening."""
    if cfg.torchserve is None and cfg.model_store is None:
        return None
    decl = cfg.torchserve or TorchServeDecl()
    store = ModelStore(cfg.model_store, decl.unpack_dir) if cfg.model_store else None
    return TorchServeFace(port, decl, store, operator, served_at_start(cfg))
