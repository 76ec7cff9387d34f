"""The callers of `tgw-bench generate-faces`: one generation streamed over each face, all on one
event loop, each with the client its users would use -

* native: tgw's `AsyncClient.generate` (one connection, a task per stream);
* grpc: tritonclient.grpc's `start_stream` / `async_stream_infer`, Triton's decoupled
  `ModelStreamInfer` - one stream, every caller's requests interleaved on it by request id, each
  answered by one response per output, then the empty final response it asks for;
* http: aiohttp POSTs to Triton's generate extension `/v2/models/{m}/generate_stream`, one
  `data:` event per output (an event with "error" fails the request);
* openai: the `openai` package's AsyncOpenAI, `completions.create(stream=True)` against
  `/v1/completions` (the prompt's bytes as ASCII text, the byte tokenizer's); a chunk is a piece
  of text (a character's bytes come together), the outputs are the usage chunk's completion_tokens.

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
    """One stream (`start_stream`), every caller's requests interleaved on it by request id, each
    read until the empty final response it asks for. tritonclient.grpc's sync client: its aio
    client refuses `triton_enable_empty_final_response`, without which a decoupled request's end
    is not seen. Its stream's thread hands each response to this loop."""
    import tritonclient.grpc as gc
    loop = asyncio.get_running_loop()
    client = gc.InferenceServerClient(url)
    pending: dict[str, asyncio.Queue] = {}

    def deliver(result, error) -> None:   # on the stream's thread
        if result is None:   # tritonclient drops an error response's id: every request open fails
            for q in list(pending.values()):
                loop.call_soon_threadsafe(q.put_nowait, (None, error))
            return
        q = pending.get(result.get_response().id)
        if q is not None:
            loop.call_soon_threadsafe(q.put_nowait, (result, None))

    ids = iter(range(1, 1 << 62))
    client.start_stream(callback=deliver, stream_timeout=timeout)
    try:
        def caller() -> Caller:
            async def call(prompt: list[int], s: Stream) -> None:
                rid = str(next(ids))
                q = pending[rid] = asyncio.Queue()
                inp = gc.InferInput("prompt", [1, len(prompt)], "INT64")   # [batch, length]
                inp.set_data_from_numpy(np.asarray([prompt], np.int64))
                try:
                    client.async_stream_infer(model, [inp], request_id=rid, parameters={"max_tokens": n},
                                              enable_empty_final_response=True)
                    while True:
                        result, error = await asyncio.wait_for(q.get(), timeout)
                        if error is not None:
                            raise RuntimeError(f"gRPC stream error: {error}")
                        token = result.as_numpy("token")
                        if token is not None and token.size:
                            s.add(int(token.reshape(-1)[0]))
                        if result.get_response().parameters["triton_final_response"].bool_param:
                            return
                finally:
                    del pending[rid]
            return call
        yield caller
    finally:
        await loop.run_in_executor(None, client.stop_stream)
        client.close()


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
                                                         max_tokens=n, temperature=0, stream=True,
                                                         stream_options={"include_usage": True})
                text, times, usage = [], [], None
                async for chunk in stream:
                    if chunk.choices:   # a piece of text, one token or more (or the finish_reason alone)
                        text.append(chunk.choices[0].text)
                        times.append(time.perf_counter())
                    if chunk.usage is not None:
                        usage = chunk.usage.completion_tokens
                if usage is None or not times:
                    raise RuntimeError("no text or no usage chunk (stream_options.include_usage)")
                # the outputs are the tokens the usage counts, each timed by the chunk it came in (at
                # the latest the last): a chunk per token, unless a character's bytes came together
                s.outputs = [0] * usage
                s.times = (times + [times[-1]] * usage)[:usage]
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
