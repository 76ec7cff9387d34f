"""The front's forwarders (broker/fronts/http_proxy.py, grpc_proxy.py) between real servers in this
process: an aiohttp app and a grpc.aio server on Unix sockets stand for the broker's own faces, a
front's server on TCP forwards to them, and real clients call the front. Each test waits on what
the upstream handler observed (an event it sets), never on time; the bounds only turn a hang
into a failure."""
from __future__ import annotations

import asyncio
import gzip
import hashlib
import os

import aiohttp
import grpc
import pytest
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tgw.broker.faces.grpc.proto import grpc_service_pb2 as pb
from tgw.broker.fronts.grpc_proxy import PEER_KEY, GrpcForwarder, tgw_methods
from tgw.broker.faces.http.shm_routes import caller_of
from tgw.broker.fronts.http_proxy import PEER_HEADER, HttpForwarder
from tgw.broker.protocol.triton_shm import front_peer_uid, parse_front_peer

pytestmark = pytest.mark.inproc
BOUND_S = 30.0   # a hang fails the test instead of stalling the suite


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, BOUND_S * 2))


async def serve(app: web.Application, **where) -> web.AppRunner:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.UnixSite(runner, where["path"]) if "path" in where else web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner


def port_of(runner: web.AppRunner) -> int:
    return runner.addresses[0][1]


# ---- HTTP --------------------------------------------------------------------------------------

class Upstream:
    """The broker's HTTP face's stand-in: echoes what reached it, streams, and notes cancellation."""

    def __init__(self):
        self.release = asyncio.Event()     # the SSE handler's second event waits for it
        self.waiting = asyncio.Event()     # the slow handler has its request
        self.cancelled = asyncio.Event()   # ... and saw its client go

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/echo", self.echo)
        app.router.add_get("/error", self.error)
        app.router.add_get("/gzipped", self.gzipped)
        app.router.add_get("/events", self.events)
        app.router.add_get("/slow", self.slow)
        app.router.add_get("/whoami", self.whoami)
        return app

    async def whoami(self, request: web.Request) -> web.Response:
        """The uid the HTTP face's shared-memory routes would see (shm_routes.caller_of)."""
        return web.json_response({"uid": caller_of(request, False).uid})

    async def echo(self, request: web.Request) -> web.Response:
        body = await request.read()
        doc = {"method": request.method, "raw_path": request.raw_path, "headers": list(request.headers.items()),
               "length": len(body), "sha": hashlib.sha256(body).hexdigest()}
        if request.query.get("back") == "body":   # the body itself back, large
            return web.Response(body=body[::-1], headers={"X-Doc-Length": str(len(body))})
        return web.json_response(doc, headers={"X-Multi": "1"})

    async def error(self, request: web.Request) -> web.Response:
        return web.json_response({"error": "Request for unknown model: 'nope' is not found", "code": "MODEL_NOT_FOUND"},
                                 status=404, headers={"tgw-code": "MODEL_NOT_FOUND"})

    async def gzipped(self, request: web.Request) -> web.Response:
        return web.Response(body=gzip.compress(b"squeezed" * 100), headers={"Content-Encoding": "gzip"},
                            content_type="text/plain")

    async def events(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: one\n\n")
        await self.release.wait()   # set by the test once the first event reached it
        await resp.write(b"data: two\n\n")
        await resp.write_eof()
        return resp

    async def slow(self, request: web.Request) -> web.Response:
        self.waiting.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


async def http_rig(tmp_path):
    upstream = Upstream()
    path = str(tmp_path / "http.sock")
    back = await serve(upstream.app(), path=path)
    await web.TCPSite(back, "127.0.0.1", 0).start()   # the same app on TCP: fronts off
    forwarder = HttpForwarder(path)
    front_app = web.Application(client_max_size=64 << 20)
    front_app.router.add_route("*", "/{tail:.*}", forwarder.handle)
    front = await serve(front_app)
    return upstream, back, forwarder, front, f"http://127.0.0.1:{port_of(front)}"


async def http_down(rigs):
    upstream, back, forwarder, front, _ = rigs
    await forwarder.close()
    await front.cleanup()
    await back.cleanup()


def test_http_requests_and_answers_pass_through_unchanged(tmp_path):
    async def main():
        rigs = await http_rig(tmp_path)
        base = rigs[-1]
        try:
            async with aiohttp.ClientSession(auto_decompress=False) as client:
                # a GET: raw query, repeated and routing headers kept, hop-by-hop and a forged peer dropped
                headers = [("Authorization", "Bearer t0k"), ("tgw-tenant", "acme"), ("traceparent", "00-ab-cd-01"),
                           ("X-Twice", "a"), ("X-Twice", "b"), ("Keep-Alive", "timeout=5"),
                           (PEER_HEADER, "uid 0")]
                async with client.get(base + "/echo?a=1&b=%20x&a=2", headers=headers) as r:
                    assert r.status == 200 and r.headers["X-Multi"] == "1"
                    doc = await r.json()
                assert doc["method"] == "GET" and doc["raw_path"] == "/echo?a=1&b=%20x&a=2" and doc["length"] == 0
                seen = doc["headers"]
                for pair in headers[:5]:
                    assert list(pair) in seen
                assert not any(k.lower() == "keep-alive" for k, _ in seen)
                peers = [v for k, v in seen if k.lower() == PEER_HEADER]
                kind, peer, local = parse_front_peer(peers[0])
                assert len(peers) == 1 and kind == "tcp" and peer[0] == "127.0.0.1" and local[1] == int(base.rsplit(":", 1)[1])
                assert front_peer_uid(peers[0]) == os.getuid()   # this process's socket, found in /proc/net/tcp
                for k in ("Accept-Encoding", "User-Agent"):   # only what the client sent
                    assert [v for n, v in seen if n == k] == [v for n, v in r.request_info.headers.items() if n == k]

                # a POST with a body of several MB, and a body as large back
                big = os.urandom(6 << 20)
                async with client.post(base + "/echo?back=body", data=big,
                                       headers={"Content-Type": "application/octet-stream"}) as r:
                    assert r.status == 200 and r.headers["X-Doc-Length"] == str(len(big))
                    assert r.headers["Content-Length"] == str(len(big)) and await r.read() == big[::-1]

                # a streamed (chunked) upload, and a gzipped one (decoded by the front's server)
                async def chunks():
                    for i in range(4):
                        yield bytes([i]) * 100_000
                async with client.put(base + "/echo", data=chunks()) as r:
                    doc = await r.json()
                assert doc["method"] == "PUT" and doc["length"] == 400_000
                async with client.post(base + "/echo", data=gzip.compress(b"x" * 5000),
                                       headers={"Content-Encoding": "gzip"}) as r:
                    doc = await r.json()
                assert doc["length"] == 5000 and doc["sha"] == hashlib.sha256(b"x" * 5000).hexdigest()

                # an error answer as the broker gave it
                async with client.get(base + "/error") as r:
                    assert r.status == 404 and r.headers["tgw-code"] == "MODEL_NOT_FOUND"
                    assert (await r.json())["code"] == "MODEL_NOT_FOUND"

                # a compressed answer: the same bytes, the same encoding
                async with client.get(base + "/gzipped") as r:
                    assert r.headers["Content-Encoding"] == "gzip"
                    squeezed = await r.read()
                    assert gzip.decompress(squeezed) == b"squeezed" * 100
                async with client.head(base + "/gzipped") as r:   # the length of what a GET would get
                    assert r.status == 200 and r.headers["Content-Length"] == str(len(squeezed))
                    assert await r.read() == b""

                # who registers shared memory: the front's word about its peer, believed on the Unix
                # socket only; a client's own claim never
                forged = {PEER_HEADER: "uid 4242"}
                async with client.get(base + "/whoami", headers=forged) as r:
                    assert (await r.json())["uid"] == os.getuid()
                direct_tcp = next(a for a in rigs[1].addresses if isinstance(a, tuple))
                async with client.get(f"http://127.0.0.1:{direct_tcp[1]}/whoami", headers=forged) as r:
                    assert (await r.json())["uid"] == os.getuid()
            async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(str(tmp_path / "http.sock"))) as unix:
                async with unix.get("http://broker/whoami", headers=forged) as r:   # as a front would say it
                    assert (await r.json())["uid"] == 4242
                async with unix.get("http://broker/whoami", headers={PEER_HEADER: "none"}) as r:
                    assert (await r.json())["uid"] is None
            assert rigs[2].forwarded == 8 and rigs[2].failed == 0
        finally:
            await http_down(rigs)
    run(main())


def test_http_streams_events_as_they_come_and_a_leaving_client_cancels(tmp_path):
    async def main():
        rigs = await http_rig(tmp_path)
        upstream, base = rigs[0], rigs[-1]
        try:
            async with aiohttp.ClientSession() as client:
                async with client.get(base + "/events") as r:
                    assert r.headers["Content-Type"] == "text/event-stream"
                    first = await r.content.readuntil(b"\n\n")   # before the upstream may finish
                    assert first == b"data: one\n\n" and not upstream.release.is_set()
                    upstream.release.set()
                    assert await r.content.read() == b"data: two\n\n"

                ask = asyncio.ensure_future(client.get(base + "/slow"))
                await upstream.waiting.wait()
                ask.cancel()   # the client closes its connection
                with pytest.raises(asyncio.CancelledError):
                    await ask
                await upstream.cancelled.wait()   # ... and the broker's face saw it go
        finally:
            await http_down(rigs)
    run(main())


def test_http_broker_unreachable_is_503_in_tgw_shape(tmp_path):
    async def main():
        forwarder = HttpForwarder(str(tmp_path / "nobody.sock"))
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", forwarder.handle)
        front = await serve(app)
        try:
            async with aiohttp.ClientSession() as client:
                async with client.post(f"http://127.0.0.1:{port_of(front)}/v2/models/m/infer", data=b"{}") as r:
                    assert r.status == 503 and r.headers["tgw-code"] == "UNAVAILABLE"
                    doc = await r.json()
            assert doc["code"] == "UNAVAILABLE" and "cannot be reached" in doc["error"] and forwarder.failed == 1
        finally:
            await forwarder.close()
            await front.cleanup()
    run(main())


# ---- gRPC --------------------------------------------------------------------------------------

TEST_METHODS = {"/t.Test/Unary": (False, False), "/t.Test/Fail": (False, False), "/t.Test/Slow": (False, False),
                "/t.Test/Local": (False, False), "/t.Test/Many": (False, True), "/t.Test/Bidi": (True, True),
                "/t.Test/Sum": (True, False)}


class GrpcUpstream:
    """The broker's gRPC face's stand-in, raw bytes."""

    def __init__(self):
        self.waiting = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.remaining: list = []
        self.metadata: list = []

    def handler(self) -> grpc.GenericRpcHandler:
        h = {"Unary": grpc.unary_unary_rpc_method_handler(self.unary),
             "Fail": grpc.unary_unary_rpc_method_handler(self.fail),
             "Slow": grpc.unary_unary_rpc_method_handler(self.slow),
             "Local": grpc.unary_unary_rpc_method_handler(self.unary),
             "Many": grpc.unary_stream_rpc_method_handler(self.many),
             "Bidi": grpc.stream_stream_rpc_method_handler(self.bidi),
             "Sum": grpc.stream_unary_rpc_method_handler(self.sum)}
        return grpc.method_handlers_generic_handler("t.Test", h)

    def live_handler(self) -> grpc.GenericRpcHandler:
        async def live(request, context):
            return pb.ServerLiveResponse(live=True).SerializeToString()
        return grpc.method_handlers_generic_handler("inference.GRPCInferenceService",
                                                    {"ServerLive": grpc.unary_unary_rpc_method_handler(live)})

    async def unary(self, request: bytes, context) -> bytes:
        self.metadata = list(context.invocation_metadata())
        self.remaining.append(context.time_remaining())
        await context.send_initial_metadata((("up-initial", "i"),))
        context.set_trailing_metadata((("up-trailer", "t"), ("up-bin", b"\x00\x01")))
        return b"up:" + request

    async def fail(self, request: bytes, context) -> bytes:
        await context.abort(grpc.StatusCode.NOT_FOUND, "Request for unknown model: 'x' is not found",
                            (("tgw-code", "MODEL_NOT_FOUND"),))

    async def slow(self, request: bytes, context) -> bytes:
        self.waiting.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def many(self, request: bytes, context):
        for i in range(int(request)):
            yield str(i).encode()

    async def bidi(self, requests, context):
        async for r in requests:
            yield r.upper()

    async def sum(self, requests, context) -> bytes:
        return str(sum([int(r) async for r in requests])).encode()


async def grpc_rig(tmp_path, up: GrpcUpstream | None):
    target = f"unix:{tmp_path}/grpc.sock"
    back = None
    if up is not None:
        back = grpc.aio.server()
        back.add_generic_rpc_handlers((up.handler(), up.live_handler()))
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), back)   # tgw's face's own
        back.add_insecure_port(target)
        await back.start()

    async def local(request: bytes, context) -> bytes:
        return b"local:" + request
    front = grpc.aio.server()
    port = front.add_insecure_port("127.0.0.1:0")
    forwarder = GrpcForwarder(target, {**tgw_methods(), **TEST_METHODS}, public_port=port)
    front.add_generic_rpc_handlers((forwarder.handler({"/t.Test/Local": grpc.unary_unary_rpc_method_handler(local)}),))
    await front.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return back, forwarder, front, channel


async def grpc_down(back, forwarder, front, channel):
    await channel.close()
    await front.stop(None)
    await forwarder.close()
    if back is not None:
        await back.stop(None)


def test_grpc_forwards_every_cardinality_with_metadata_status_and_deadline(tmp_path):
    async def main():
        up = GrpcUpstream()
        back, forwarder, front, channel = rigs = await grpc_rig(tmp_path, up)
        try:
            call = channel.unary_unary("/t.Test/Unary")(b"hi", timeout=20, metadata=(
                ("authorization", "Bearer t0k"), ("tgw-tenant", "acme"), ("x-bin", b"\xff"), (PEER_KEY, "forged")))
            assert await call == b"up:hi"
            assert ("up-initial", "i") in tuple(await call.initial_metadata())
            trailing = tuple(await call.trailing_metadata())
            assert ("up-trailer", "t") in trailing and ("up-bin", b"\x00\x01") in trailing
            seen = up.metadata
            for pair in (("authorization", "Bearer t0k"), ("tgw-tenant", "acme"), ("x-bin", b"\xff")):
                assert pair in seen
            peers = [v for k, v in seen if k == PEER_KEY]
            assert len(peers) == 1 and peers[0].startswith("tcp 127.0.0.1 ") and front_peer_uid(peers[0]) == os.getuid()
            # the caller's deadline, less the hop (gRPC's timeout header rounds up: a little over 20 s)
            assert 10 < up.remaining[-1] < 21
            await channel.unary_unary("/t.Test/Unary")(b"x")
            assert up.remaining[-1] is None       # none given, none invented

            with pytest.raises(grpc.aio.AioRpcError) as err:
                await channel.unary_unary("/t.Test/Fail")(b"")
            assert err.value.code() == grpc.StatusCode.NOT_FOUND and "'x' is not found" in err.value.details()
            assert ("tgw-code", "MODEL_NOT_FOUND") in tuple(err.value.trailing_metadata())

            assert [m async for m in channel.unary_stream("/t.Test/Many")(b"5")] == [b"0", b"1", b"2", b"3", b"4"]
            bidi = channel.stream_stream("/t.Test/Bidi")()
            for word in (b"ab", b"cd"):   # each answer before the next request: nothing waits for the end
                await bidi.write(word)
                assert await bidi.read() == word.upper()
            await bidi.done_writing()
            assert await bidi.read() == grpc.aio.EOF
            async def numbers():
                for i in range(1, 5):
                    yield str(i).encode()
            assert await channel.stream_unary("/t.Test/Sum")(numbers()) == b"10"

            assert await channel.unary_unary("/t.Test/Local")(b"me") == b"local:me"   # served by the front
            live = await channel.unary_unary("/inference.GRPCInferenceService/ServerLive",
                                             request_serializer=pb.ServerLiveRequest.SerializeToString,
                                             response_deserializer=pb.ServerLiveResponse.FromString)(
                pb.ServerLiveRequest())
            assert live.live
            probe = health_pb2_grpc.HealthStub(channel)
            assert (await probe.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING
            watch = probe.Watch(health_pb2.HealthCheckRequest())   # a stream that lasts: its first answer
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await channel.unary_unary("/t.Test/Nope")(b"")
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED

            ask = channel.unary_unary("/t.Test/Slow")(b"")
            await up.waiting.wait()
            ask.cancel()
            await up.cancelled.wait()   # the caller's cancel reached the broker's face
            assert forwarder.forwarded == 10
        finally:
            await grpc_down(*rigs)
    run(main())


def test_grpc_broker_unreachable_is_unavailable(tmp_path):
    async def main():
        rigs = await grpc_rig(tmp_path, None)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await rigs[3].unary_unary("/t.Test/Unary")(b"")
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert await rigs[3].unary_unary("/t.Test/Local")(b"ok") == b"local:ok"
        finally:
            await grpc_down(*rigs)
    run(main())


def test_tgw_methods_name_every_service_the_face_serves():
    methods = tgw_methods()
    assert methods["/inference.GRPCInferenceService/ModelInfer"] == (False, False)
    assert methods["/inference.GRPCInferenceService/ModelStreamInfer"] == (True, True)
    assert methods["/grpc.health.v1.Health/Watch"] == (False, True)
    assert methods["/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"] == (True, True)
