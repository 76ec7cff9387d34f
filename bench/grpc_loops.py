"""Does grpc.aio serve well on uvloop? The measurement behind running the gRPC face on the broker's
own loop (docs/GRPC.md): a bare grpc.aio server (an echo handler) on uvloop and on asyncio's own
loop, each in turn in a subprocess, loaded by a grpc.aio client in another process:

* 2,000 sequential unary calls: p50 and p99 latency;
* 4,000 unary calls at concurrency 64 (64 channels): calls/s, all answered;
* one bidirectional stream of 1,000 requests: all answered in order, and its seconds.

    python -m tgw.bench.grpc_loops [--rounds 3]    # writes bench/results/grpc-loops-<date>.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SERVER = r"""
import asyncio, sys, grpc
async def main():
    server = grpc.aio.server()
    async def echo(req, ctx):
        return req
    async def stream(reqs, ctx):
        async for r in reqs:
            yield r
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Echo", {
        "Unary": grpc.unary_unary_rpc_method_handler(echo),
        "Stream": grpc.stream_stream_rpc_method_handler(stream)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)   # until the parent closes it
    await server.stop(0)
if sys.argv[1] == "uvloop":
    import uvloop
    uvloop.run(main())
else:
    asyncio.run(main())
"""

CLIENT = r"""
import asyncio, json, sys, time, grpc
target, body = sys.argv[1], b"x" * 1024
async def main():
    out = {}
    async with grpc.aio.insecure_channel(target) as ch:
        unary = ch.unary_unary("/bench.Echo/Unary")
        lat = []
        for _ in range(2000):
            t0 = time.perf_counter(); await unary(body); lat.append(time.perf_counter() - t0)
        lat.sort()
        out["sequential_p50_us"], out["sequential_p99_us"] = lat[1000] * 1e6, lat[1980] * 1e6
    chans = [grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(64)]
    calls, answered = [c.unary_unary("/bench.Echo/Unary") for c in chans], 0
    async def run(call):
        nonlocal answered
        for _ in range(4000 // 64):
            if await call(body) == body:
                answered += 1
    t0 = time.perf_counter()
    await asyncio.gather(*(run(c) for c in calls))
    out["concurrent_calls_per_s"], out["concurrent_answered"] = answered / (time.perf_counter() - t0), answered
    for c in chans:
        await c.close()
    async with grpc.aio.insecure_channel(target) as ch:
        call = ch.stream_stream("/bench.Echo/Stream")()
        t0, ok = time.perf_counter(), 0
        async def write():
            for i in range(1000):
                await call.write(i.to_bytes(4, "little"))
            await call.done_writing()
        writer = asyncio.ensure_future(write())
        for i in range(1000):
            ok += await call.read() == i.to_bytes(4, "little")
        await writer
        out["stream_s"], out["stream_answered_in_order"] = time.perf_counter() - t0, ok
    print(json.dumps(out))
asyncio.run(main())
"""


def one(loop: str) -> dict:
    server = subprocess.Popen([sys.executable, "-c", SERVER, loop], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        port = int(server.stdout.readline())
        client = subprocess.run([sys.executable, "-c", CLIENT, f"127.0.0.1:{port}"], capture_output=True, text=True,
                                timeout=300)
        if client.returncode != 0:
            raise RuntimeError(client.stderr[-2000:])
        return json.loads(client.stdout.strip().splitlines()[-1])
    finally:
        server.stdin.close()
        server.wait(30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tgw.bench.grpc_loops", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = p.parse_args(argv)
    runs: dict[str, list] = {"uvloop": [], "asyncio": []}
    for _ in range(a.rounds):   # alternating, so a drift of the machine's load hits both alike
        for loop in runs:
            runs[loop].append(one(loop))
            print(loop, json.dumps(runs[loop][-1]), flush=True)
    date = time.strftime("%Y-%m-%d-%H%M%S")
    path = os.path.join(a.out, f"grpc-loops-{date}.json")
    with open(path, "w") as f:
        json.dump({"command": "python -m tgw.bench.grpc_loops --rounds %d" % a.rounds, "date": date,
                   "cpus": os.cpu_count(), "runs": runs}, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
