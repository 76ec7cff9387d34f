#!/usr/bin/env python
"""What a front's forwarders cost (broker/fronts/http_proxy.py, grpc_proxy.py): CPU per forwarded
small HTTP request and small gRPC unary call in the forwarding process, beside the direct call.

Three processes, each on uvloop as the broker is: a stand-in for the broker's faces (an aiohttp
app answering a small JSON document, a grpc.aio server answering a small raw unary call, each on a
Unix socket and on TCP), a front (HttpForwarder and GrpcForwarder on TCP, forwarding to those Unix
sockets), and the client, this process (aiohttp and grpc.aio, `--concurrency` callers). Each
phase's figure is the process's CPU time (user + system, psutil) over the phase divided by its
requests, so the forwarder's own cost is the front's figure; the stand-in's figure in the direct
phase is what answering costs a face, for scale.

    python scripts/forwarder-cost.py --requests 4000 --concurrency 8 --out bench/results/forwarders.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import tempfile
import time

DOC = b'{"ready":true,"models":{"mlp":true}}'
METHOD = "/inference.GRPCInferenceService/ServerLive"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def upstream_main(folder: str, http_port: int, grpc_port: int, ready) -> None:
    import grpc
    import uvloop
    from aiohttp import web

    async def main():
        async def doc(request):
            return web.Response(body=DOC, content_type="application/json")
        app = web.Application()
        app.router.add_get("/v2/health/ready", doc)
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        await web.UnixSite(runner, os.path.join(folder, "http.sock")).start()
        await web.TCPSite(runner, "127.0.0.1", http_port).start()

        async def live(request, context):
            return b"\x08\x01"   # ServerLiveResponse(live=True)
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "inference.GRPCInferenceService", {"ServerLive": grpc.unary_unary_rpc_method_handler(live)}),))
        server.add_insecure_port(f"unix:{folder}/grpc.sock")
        server.add_insecure_port(f"127.0.0.1:{grpc_port}")
        await server.start()
        ready.set()
        await asyncio.Event().wait()
    uvloop.run(main())


def front_main(folder: str, http_port: int, grpc_port: int, ready) -> None:
    import grpc
    import uvloop
    from aiohttp import web

    from tgw.broker.fronts.grpc_proxy import GrpcForwarder
    from tgw.broker.fronts.http_proxy import HttpForwarder

    async def main():
        http = HttpForwarder(os.path.join(folder, "http.sock"))
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", http.handle)
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", http_port).start()
        forwarder = GrpcForwarder(f"unix:{folder}/grpc.sock")
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((forwarder.handler({}),))
        server.add_insecure_port(f"127.0.0.1:{grpc_port}")
        await server.start()
        ready.set()
        await asyncio.Event().wait()
    uvloop.run(main())


async def drive_http(port: int, requests: int, concurrency: int) -> list[float]:
    import aiohttp
    url = f"http://127.0.0.1:{port}/v2/health/ready"
    lat: list[float] = []
    left = [requests]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as client:
        async def caller():
            while left[0] > 0:
                left[0] -= 1
                t = time.perf_counter()
                async with client.get(url) as r:
                    assert await r.read() == DOC
                lat.append(time.perf_counter() - t)
        await asyncio.gather(*(caller() for _ in range(concurrency)))
    return lat


async def drive_grpc(port: int, requests: int, concurrency: int) -> list[float]:
    import grpc
    lat: list[float] = []
    left = [requests]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(METHOD)
        async def caller():
            while left[0] > 0:
                left[0] -= 1
                t = time.perf_counter()
                assert await call(b"") == b"\x08\x01"
                lat.append(time.perf_counter() - t)
        await asyncio.gather(*(caller() for _ in range(concurrency)))
    return lat


def cpu(proc) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def main() -> int:
    import psutil
    import uvloop

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=4000, help="requests per phase")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="each phase this many times; the median is reported")
    ap.add_argument("--out", help="write the result (JSON) here")
    args = ap.parse_args()

    folder = tempfile.mkdtemp(prefix="tgw-fwd-")
    ports = {k: free_port() for k in ("up_http", "up_grpc", "front_http", "front_grpc")}
    ctx = mp.get_context("spawn")
    procs = []
    for target, http_port, grpc_port in ((upstream_main, ports["up_http"], ports["up_grpc"]),
                                         (front_main, ports["front_http"], ports["front_grpc"])):
        ready = ctx.Event()
        p = ctx.Process(target=target, args=(folder, http_port, grpc_port, ready), daemon=True)
        p.start()
        if not ready.wait(60):
            raise SystemExit(f"{target.__name__} did not start")
        procs.append(p)
    up, front = (psutil.Process(p.pid) for p in procs)
    phases = {"http direct": (drive_http, ports["up_http"]), "http forwarded": (drive_http, ports["front_http"]),
              "grpc direct": (drive_grpc, ports["up_grpc"]), "grpc forwarded": (drive_grpc, ports["front_grpc"])}
    rows: dict[str, list[dict]] = {name: [] for name in phases}
    try:
        for name, (drive, port) in phases.items():   # warm each path once
            uvloop.run(drive(port, 300, args.concurrency))
        for _ in range(args.rounds):
            for name, (drive, port) in phases.items():
                u0, f0, w0 = cpu(up), cpu(front), time.perf_counter()
                lat = uvloop.run(drive(port, args.requests, args.concurrency))
                wall = time.perf_counter() - w0
                n = len(lat)
                rows[name].append({"upstream_cpu_us": (cpu(up) - u0) / n * 1e6,
                                   "front_cpu_us": (cpu(front) - f0) / n * 1e6,
                                   "req_per_s": n / wall, "p50_ms": statistics.median(lat) * 1e3})
    finally:
        for p in procs:
            p.kill()
            p.join()
    summary = {name: {k: round(statistics.median(r[k] for r in rs), 1) for k in rs[0]} for name, rs in rows.items()}
    for face in ("http", "grpc"):
        d, f = summary[f"{face} direct"], summary[f"{face} forwarded"]
        summary[f"{face} forwarder cpu per request, us"] = f["front_cpu_us"]
        summary[f"{face} forwarder cpu / direct face cpu"] = round(f["front_cpu_us"] / d["upstream_cpu_us"], 2)
    result = {"command": "python scripts/forwarder-cost.py " + " ".join(sys.argv[1:]),
              "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "host": platform.node(),
              "cpus": os.cpu_count(), "requests": args.requests, "concurrency": args.concurrency,
              "rounds": args.rounds, "summary": summary, "rounds_detail": rows}
    text = json.dumps(result, indent=1)
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
