"""Polled jobs over HTTP (docs/JOBS.md#http): submit a KServe v2 infer body as a job, read its
state and outputs so far, fetch its result, cancel it. The job itself is the jobs wing's (it
answers through the door like any native caller's job); this module only maps HTTP to its
messages and back.

`POST /v2/models/{m}[/versions/{v}]/jobs` takes the body `/infer` takes (JSON, or JSON and
binary); for a generator it is a generation, its parameters (max_tokens, temperature, top_k,
top_p, seed, stop_tokens) read by broker/protocol/streaming.generate_params. 202 with the job's
id and status URL. `GET /v2/jobs/{id}` (`?since=N`, `?wait_ms=M`): the state and the outputs so
far as KServe JSON outputs. `GET /v2/jobs/{id}/result`: the KServe infer response once done
(JSON, or with `?binary_data=true` the binary tensor extension's);
202 with the status while the job runs; the job's error (its own status) when it failed; 409
when it was cancelled. `DELETE /v2/jobs/{id}`: cancel; the status after.
"""
from __future__ import annotations

import asyncio

import orjson
from aiohttp import web

from tgw.shm.errors import Code, error_from_body, fail
from tgw.shm.wire import PROTOCOL_VERSION, ErrorReply, InferReply, JobCancel, JobQuery

from tgw.broker.protocol import door, kserve
from tgw.broker.protocol.door import DoorPort
from tgw.broker.protocol.errors import bad
from tgw.broker.protocol.streaming import generate_params

from .answers import HttpCaller, error_response, json_response


def tensors_response(doc: dict, status: int = 200) -> web.Response:
    """A JSON answer holding outputs' data (numpy arrays, as kserve.json_data gives them)."""
    return web.Response(status=status, body=orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY),
                        content_type="application/json")

GENERATE_KEYS = ("max_tokens", "max_outputs", "temperature", "top_k", "top_p", "seed", "stop_tokens")


class JobRoutes:
    def __init__(self, deps: DoorPort, body, decode, tenant_header: str):
        # body(request): the request's body; decode(request, model, body): its Decoded (face.py)
        self.deps, self.body, self.decode, self.tenant_header = deps, body, decode, tenant_header

    def routes(self) -> list[tuple[str, str, object]]:
        return [("POST", "/v2/models/{model}/jobs", self.submit),
                ("POST", "/v2/models/{model}/versions/{version}/jobs", self.submit),
                ("GET", "/v2/jobs/{job_id}", self.status), ("GET", "/v2/jobs/{job_id}/result", self.result),
                ("DELETE", "/v2/jobs/{job_id}", self.cancel)]

    async def submit(self, request: web.Request) -> web.Response:
        model = request.match_info["model"]
        body = await self.body(request)
        decoded = await self.decode(request, model, body)
        msg = decoded.infer
        length = request.headers.get(kserve.HEADER_LENGTH)
        raw = kserve.is_raw(request.method, request.headers.get("Content-Type"), length)
        params, shm = ({}, False) if raw else parameters(body, length)
        if shm or decoded.places:
            raise bad("a job's inputs must travel in its body and its outputs are kept by the broker: shared "
                      "memory regions are not for jobs", parameter=kserve.SHM_REGION)
        if decoded.classes:   # a job keeps its outputs as computed: refused, never silently ignored
            raise bad("a job's outputs are kept as computed: ask for classification on a synchronous infer",
                      parameter="classification")
        generator = model not in self.deps.view.pipelines.table and self.deps.entry(model).is_generator
        if generator:
            msg.generate = generate_params(params)
        elif any(k in params for k in GENERATE_KEYS):
            raise bad(f"parameter {next(k for k in GENERATE_KEYS if k in params)!r} is for generators; model "
                      f"{model!r} is not one", parameter=next(k for k in GENERATE_KEYS if k in params))
        msg.job = True
        caller = HttpCaller(asyncio.get_running_loop())
        self.deps.infer(caller, msg, decoded.frames)
        reply, _ = await caller.future
        if isinstance(reply, ErrorReply):
            return error_response(error_from_body(reply.error))
        return json_response({"job_id": reply.job_id, "status_url": f"/v2/jobs/{reply.job_id}", "model_name": model,
                              "generate": reply.generate, "keep_s": reply.keep_s}, 202)

    async def status(self, request: web.Request) -> web.Response:
        query = request.rel_url.query
        reply, frames = await self.ask(JobQuery(v=PROTOCOL_VERSION, id=0, job_id=request.match_info["job_id"],
                                                since=count(query, "since"), wait_ms=count(query, "wait_ms"),
                                                tenant=request.headers.get(self.tenant_header)))
        return tensors_response(status_doc(reply, frames))

    async def result(self, request: web.Request) -> web.Response:
        reply, frames = await self.ask(JobQuery(v=PROTOCOL_VERSION, id=0, job_id=request.match_info["job_id"],
                                                tenant=request.headers.get(self.tenant_header)))
        if reply.state == "failed":
            return error_response(error_from_body(reply.error))
        if reply.state == "cancelled":
            return json_response({"error": f"job {reply.job_id} was cancelled: it has no result", "code": "CANCELLED",
                                  "job": status_doc(reply, [])}, 409)
        if reply.state != "done":   # not yet: the status, and when to ask again
            resp = tensors_response(status_doc(reply, frames), 202)
            resp.headers["Retry-After"] = "1"
            return resp
        binary = request.rel_url.query.get("binary_data", "false")
        if binary not in ("true", "false"):
            raise bad(f"query parameter binary_data must be true or false, got {binary!r}", parameter="binary_data")
        if binary == "true":   # the binary tensor extension: the JSON header, then the outputs' bytes
            header, blobs = kserve.encode(InferReply(v=PROTOCOL_VERSION, id=0, model=reply.model,
                                                     version=reply.version, outputs=reply.outputs), frames, None, True)
            return web.Response(body=b"".join([header, *blobs]), content_type="application/octet-stream",
                                headers={kserve.HEADER_LENGTH: str(len(header))})
        doc = {"model_name": reply.model, "model_version": reply.version, "outputs": json_outputs(reply, frames)}
        return tensors_response(doc)

    async def cancel(self, request: web.Request) -> web.Response:
        reply, frames = await self.ask(JobCancel(v=PROTOCOL_VERSION, id=0, job_id=request.match_info["job_id"],
                                                 tenant=request.headers.get(self.tenant_header)))
        return tensors_response(status_doc(reply, frames))

    async def ask(self, msg):
        return await door.ask(self.deps, msg, HttpCaller(asyncio.get_running_loop()))


def parameters(body: bytes, length: str | None) -> tuple[dict, bool]:
    """The body's request parameters, and whether an input names a shared memory region (the
    body decoded already: it is well formed)."""
    doc = orjson.loads(memoryview(body)[:kserve.header_length(length, len(body))])
    shm = any(isinstance(t, dict) and kserve.SHM_REGION in (t.get("parameters") or {}) for t in doc["inputs"])
    return kserve.mapping(doc.get("parameters"), "parameters"), shm


def count(query, key: str) -> int:
    value = query.get(key, "0")
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise fail(Code.INVALID_ARGUMENT, f"query parameter {key} must be an integer >= 0, got {value!r}",
                   parameter=key)
    return n


def json_outputs(reply, frames: list) -> list[dict]:
    return [{"name": m.name, "datatype": kserve.DATATYPE_OF[m.dtype], "shape": m.shape,
             "data": kserve.json_data(m.name, m.dtype, m.shape, f)} for m, f in zip(reply.outputs, frames)]


def status_doc(reply, frames: list) -> dict:
    doc = {"job_id": reply.job_id, "model_name": reply.model, "model_version": reply.version, "state": reply.state,
           "generate": reply.generate, "outputs": json_outputs(reply, frames), "first": reply.first,
           "count": reply.count, "total": reply.total, "age_ms": reply.age_ms, "run_ms": reply.run_ms,
           "expires_in_s": reply.expires_in_s}
    if reply.error is not None:
        doc["error"] = {"code": reply.error.code, "message": reply.error.message}
    if reply.end:
        doc["end"] = reply.end
    return doc
