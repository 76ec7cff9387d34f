"""The callers of `tgw-bench generate-faces`: one generation streamed over each face, all on one
event loop, each with the client its users would use -

* native: tgw's `AsyncClient.generate` (one connection, a task per stream);
* grpc: tritonclient's `grpc.aio` client, Triton's decoupled `ModelStreamInfer` - one gRPC stream
  per concurrent caller, its requests sent one after another on it, each answered by one response
  per output until `triton_final_response`;
* http: aiohttp POSTs to Triton's generate extension `/v2/models/{m}/generate_stream`, one
  `data:` event per output (an event with "error" fails the request);
* openai: the `openai` package's AsyncOpenAI, `completions.create(stream=True)` against
  `/v1/completions`, one chunk per output (text: the prompt's bytes as ASCII, the byte tokenizer's).

`face_loop` runs N callers at once, each its requests back to back, and returns gen_drive's
Streams (one per request: outputs and when each came) for `gen_drive.summary`.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any, AsyncIterator, Awaitable, Callable

import numpy as np

from tgw.bench.harness.gen_drive import Stream

FACES = ("native", "grpc", "http", "openai")
Caller = Callable[[list[int], Stream], Awaitable[None]]   # one request: fills the Stream as outputs come


@contextlib.asynccontextmanager
async def native(address: str, model: str, n: int, timeout: float) -> AsyncIterator[Callable[[], Caller]]:
    from tgw.client import AsyncClient
    async with AsyncClient(address) as ac:
        await ac.health()   # connected before the clock starts

        def caller() -> Caller:
            async def call(prompt: list[int], s: Stream) -> None:
                it = ac.generate(model, np.asarray(prompt, np.int64), max_outputs=n, timeout=timeout)
                async for value in it:
                    s.add(value)
                s.final = it.final
            return call
        yield caller


@contextlib.asynccontextmanager
async def grpc(url: str, model: str, n: int, timeout: float) -> AsyncIterator[Callable[[], Caller]]:
    """Each caller opens its own decoupled stream at its first request and keeps it."""
    import tritonclient.grpc as gc
    from tritonclient.grpc import aio
    client = aio.InferenceServerClient(url)
    streams: list[Any] = []
    try:
        await client.is_server_ready()

        def caller() -> Caller:
            send: asyncio.Queue = asyncio.Queue()
            state: dict[str, Any] = {"it": None, "count": 0}

            async def requests():
                while True:
                    req = await send.get()
                    if req is None:
                        return
                    yield req

            async def call(prompt: list[int], s: Stream) -> None:
                if state["it"] is None:
                    state["it"] = client.stream_infer(requests(), stream_timeout=timeout)
                    streams.append((send, state["it"]))
                state["count"] += 1
                rid = str(state["count"])
                inp = gc.InferInput("prompt", [1, len(prompt)], "INT64")   # [batch, length]
                inp.set_data_from_numpy(np.asarray([prompt], np.int64))
                await send.put({"model_name": model, "inputs": [inp], "request_id": rid,
                                "parameters": {"max_tokens": n}})
                async for result, error in state["it"]:
                    if error is not None:
                        raise RuntimeError(f"gRPC stream error: {error}")
                    resp = result.get_response()
                    if resp.id != rid:
                        raise RuntimeError(f"a response for request {resp.id!r} while {rid!r} streams")
                    token = result.as_numpy("token")
                    if token is not None and token.size:
                        s.add(int(token.reshape(-1)[0]))
                    final = resp.parameters.get("triton_final_response")
                    if final is not None and final.bool_param:
                        return
                raise RuntimeError("the gRPC stream ended before triton_final_response")
            return call
        yield caller
    finally:
        for send, it in streams:
            send.put_nowait(None)
            it.cancel()
        await client.close()


@contextlib.asynccontextmanager
async def http(base: str, model: str, n: int, timeout: float) -> AsyncIterator[Callable[[], Caller]]:
    import aiohttp
    url = f"{base}/v2/models/{model}/generate_stream"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        def caller() -> Caller:
            async def call(prompt: list[int], s: Stream) -> None:
                async with session.post(url, json={"prompt": prompt, "parameters": {"max_tokens": n}}) as resp:
                    if resp.status != 200:
                        raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                    async for line in resp.content:
                        if not line.startswith(b"data:"):
                            continue
                        event = json.loads(line[5:])
                        if "error" in event:
                            raise RuntimeError(f"error event: {event['error']}")
                        token = event["token"]
                        s.add(token[0] if isinstance(token, list) else token)
            return call
        yield caller


@contextlib.asynccontextmanager
async def openai(base: str, model: str, n: int, timeout: float) -> AsyncIterator[Callable[[], Caller]]:
    from openai import AsyncOpenAI
    async with AsyncOpenAI(base_url=f"{base}/v1", api_key="bench", max_retries=0, timeout=timeout) as client:
        def caller() -> Caller:
            async def call(prompt: list[int], s: Stream) -> None:
                stream = await client.completions.create(model=model, prompt=bytes(prompt).decode("ascii"),
                                                         max_tokens=n, temperature=0, stream=True)
                text = []
                async for chunk in stream:
                    if chunk.choices:
                        text.append(chunk.choices[0].text)
                        s.add(0)   # a chunk is an output; its text is checked below, not per token
                s.final = "".join(text)
            return call
        yield caller


def face(name: str, addresses: dict[str, str], model: str, n: int, timeout: float):
    """The face's async context: yields caller() -> a Caller (one per concurrent stream)."""
    where = {"native": addresses.get("native"), "grpc": addresses.get("grpc"),
             "http": addresses.get("http"), "openai": addresses.get("http")}[name]
    if not where:
        raise RuntimeError(f"the broker serves no {name} face")
    return {"native": native, "grpc": grpc, "http": http, "openai": openai}[name](where, model, n, timeout)


async def face_loop(name: str, addresses: dict[str, str], model: str, prompt_list: list[list[int]], streams: int,
                    per_stream: int, n: int, timeout: float, first_index: int = 0,
                    around: Callable[[], Any] = lambda: None) -> tuple[list[Stream], float, Any, Any]:
    """`streams` callers on this loop, each `per_stream` requests back to back; returns the
    requests, the wall seconds and what `around()` gave just before and just after the clock
    (the broker's CPU times)."""
    out: list[Stream] = []
    async with face(name, addresses, model, n, timeout) as caller:
        async def one(i: int) -> None:
            call = caller()
            for k in range(per_stream):
                s = Stream(time.perf_counter(), prompt_list[(first_index + i * per_stream + k) % len(prompt_list)])
                try:
                    await call(s.prompt, s)
                except Exception as exc:  # noqa: BLE001 - recorded: the row counts its failures
                    s.error = f"{type(exc).__name__}: {exc}"
                out.append(s)
        before = around()
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(streams)))
        wall = time.perf_counter() - t0
        after = around()
    return out, wall, before, after
