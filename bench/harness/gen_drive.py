"""The generation benchmark's callers (`tgw-bench generate`): one function per system that runs one
request and returns its outputs with the time each arrived, and a closed loop that runs N streams
at once, each thread its requests back to back.

A stream's figures: time to first output (from the call to the first output), time between
outputs (each gap after the first), outputs/s of the level (every output / the level's wall time).
"""
from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np


@dataclass
class Stream:
    """One request's outputs and when each arrived (perf_counter seconds)."""
    start: float
    prompt: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    error: str = ""
    final: Any = None

    def add(self, value: int) -> None:
        self.outputs.append(int(value))
        self.times.append(time.perf_counter())


Call = Callable[[list[int], Stream], None]   # fills the Stream as outputs come


# ---- the systems ----------------------------------------------------------------------------------

def http_stream(port: int, path: str, parse: Callable[[bytes], int], max_outputs: int) -> Call:
    """A POST of {"prompt", "max_outputs"} whose answer streams one output a line."""
    def call(prompt: list[int], s: Stream) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        try:
            conn.request("POST", path, json.dumps({"prompt": prompt, "max_outputs": max_outputs}),
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                s.error = f"HTTP {resp.status}: {resp.read()[:200]!r}"
                return
            while True:
                line = resp.readline()
                if not line:
                    break
                if line.strip():
                    s.add(parse(line))
        except Exception as exc:  # noqa: BLE001 - recorded: the row counts its failures
            s.error = f"{type(exc).__name__}: {exc}"
        finally:
            conn.close()
    return call


def flask_call(port: int, max_outputs: int) -> Call:
    return http_stream(port, "/generate", int, max_outputs)


def litserve_call(port: int, max_outputs: int) -> Call:
    return http_stream(port, "/predict", lambda line: json.loads(line)["output"], max_outputs)


def oneshot_call(client, model: str, max_len: int, max_outputs: int) -> Call:
    """tgw before generators: one `Client.infer` per output, the whole sequence so far each time."""
    def call(prompt: list[int], s: Stream) -> None:
        tokens = np.zeros((1, max_len), np.int64)
        tokens[0, :len(prompt)] = prompt
        n = len(prompt)
        try:
            for _ in range(max_outputs):
                out = client.infer(model, {"tokens": tokens, "length": np.array([n], np.int64)}, timeout=600)
                tok = int(out["token"][0])
                s.add(tok)
                tokens[0, n] = tok
                n += 1
        except Exception as exc:  # noqa: BLE001
            s.error = f"{type(exc).__name__}: {exc}"
    return call


def generate_call(client, model: str, max_outputs: int, **options) -> Call:
    """tgw generate: `Client.generate`, its outputs as they come, `.final` after the end."""
    def call(prompt: list[int], s: Stream) -> None:
        try:
            it = client.generate(model, {"prompt": np.asarray(prompt, np.int64)}, max_outputs=max_outputs, **options)
            for out in it:
                s.add(out)
            s.final = getattr(it, "final", None)
        except Exception as exc:  # noqa: BLE001
            s.error = f"{type(exc).__name__}: {exc}"
    return call


# ---- the closed loop ------------------------------------------------------------------------------

def closed_loop(call: Call, prompt_list: list[list[int]], streams: int, per_stream: int,
                first_index: int = 0) -> tuple[list[Stream], float]:
    """`streams` threads, each `per_stream` requests back to back (prompts taken in turn from
    prompt_list); every thread starts at once. Returns the requests and the wall seconds."""
    out: list[Stream] = []
    lock, barrier = threading.Lock(), threading.Barrier(streams + 1)

    def run(i: int) -> None:
        barrier.wait()
        for k in range(per_stream):
            s = Stream(time.perf_counter(), prompt_list[(first_index + i * per_stream + k) % len(prompt_list)])
            call(s.prompt, s)
            with lock:
                out.append(s)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(streams)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return out, time.perf_counter() - t0


def async_closed_loop(address: str, model: str, prompt_list: list[list[int]], streams: int, per_stream: int,
                      max_outputs: int, timeout: float, first_index: int = 0) -> tuple[list[Stream], float]:
    """As closed_loop, for tgw generate through one AsyncClient: `streams` tasks on one event
    loop (in this thread), each its requests back to back."""
    import asyncio
    from tgw.client import AsyncClient
    out: list[Stream] = []

    async def one(ac, i: int) -> None:
        for k in range(per_stream):
            s = Stream(time.perf_counter(), prompt_list[(first_index + i * per_stream + k) % len(prompt_list)])
            try:
                it = ac.generate(model, np.asarray(s.prompt, np.int64), max_outputs=max_outputs, timeout=timeout)
                async for value in it:
                    s.add(value)
                s.final = it.final
            except Exception as exc:  # noqa: BLE001 - recorded: the row counts its failures
                s.error = f"{type(exc).__name__}: {exc}"
            out.append(s)

    async def main() -> float:
        async with AsyncClient(address) as ac:
            await ac.health()   # connected before the clock starts, as the threads' clients are
            t0 = time.perf_counter()
            await asyncio.gather(*(one(ac, i) for i in range(streams)))
            return time.perf_counter() - t0

    wall = asyncio.run(main())
    return out, wall


def _pct(values: list[float], q: float) -> Optional[float]:
    return float(np.percentile(values, q)) if values else None


def summary(streams: list[Stream], wall: float, expected: int,
            check: Optional[Callable[[list[int], list[int]], str]] = None) -> dict[str, Any]:
    """A level's row: outputs/s, time to first output and between outputs (ms), failures; with
    `check(prompt, outputs)` (a message when they are wrong), how many complete requests had the
    reference's outputs."""
    ok = [s for s in streams if not s.error and len(s.outputs) == expected]
    ttfo = [1e3 * (s.times[0] - s.start) for s in ok]
    gaps = [1e3 * g for s in ok for g in np.diff(s.times)]
    errors: dict[str, int] = {}
    for s in streams:
        if s.error or len(s.outputs) != expected:
            key = (s.error or f"{len(s.outputs)} outputs, not {expected}")[:160]
            errors[key] = errors.get(key, 0) + 1
    return {"requests": len(streams), "requests_failed": len(streams) - len(ok),
            "outputs": sum(len(s.outputs) for s in streams), "wall_s": wall,
            "outputs_per_s": sum(len(s.outputs) for s in ok) / wall if wall > 0 else None,
            "ttfo_ms": {"p50": _pct(ttfo, 50), "p99": _pct(ttfo, 99)},
            "between_ms": {"p50": _pct(gaps, 50), "p99": _pct(gaps, 99), "max": max(gaps) if gaps else None},
            "errors": errors, **(_checked(ok, check) if check else {})}


def _checked(ok: list[Stream], check: Callable[[list[int], list[int]], str]) -> dict[str, Any]:
    wrong = [m for m in (check(s.prompt, s.outputs) for s in ok) if m]
    return {"outputs_checked": len(ok), "outputs_wrong": len(wrong), "first_wrong": wrong[0] if wrong else None}


def newcomer(call: Call, prompt_list: list[list[int]], others: int, head_start: int,
             limit_s: float) -> dict[str, Any]:
    """A request arriving while `others` generate: they start together; once they have received
    `head_start` outputs each on average, one more request starts. Returns its time to first
    output and, per other stream that was receiving meanwhile, the outputs it got between the
    newcomer's call and its first output (each is a step the newcomer waited through). Bounded:
    gives up after limit_s."""
    streams = [Stream(time.perf_counter()) for _ in range(others)]
    threads = [threading.Thread(target=_fill, args=(call, prompt_list[i % len(prompt_list)], s), daemon=True)
               for i, s in enumerate(streams)]
    for s, t in zip(streams, threads):
        s.start = time.perf_counter()
        t.start()
    end = time.monotonic() + limit_s
    while sum(len(s.outputs) for s in streams) < head_start * others and any(t.is_alive() for t in threads):
        if time.monotonic() > end:
            return {"error": f"the {others} others had not sent {head_start} outputs each in {limit_s:g} s"}
        time.sleep(0.001)   # a bench polling its own threads, not a test's wait
    late = Stream(time.perf_counter())
    _fill(call, prompt_list[others % len(prompt_list)], late)
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    if late.error or not late.times:
        return {"error": late.error or "the newcomer got no output"}
    first = late.times[0]
    during = [sum(1 for t in s.times if late.start <= t <= first) for s in streams]
    active = [d for d in during if d]
    unfinished = sum(1 for s in streams if s.times and s.times[-1] > first)
    return {"others": others, "head_start_outputs": head_start, "ttfo_ms": 1e3 * (first - late.start),
            "steps_waited": float(np.median(active)) if active else 0.0,
            "others_receiving": len(active), "others_unfinished_at_its_first": unfinished,
            "others_failed": sum(1 for s in streams if s.error)}


def _fill(call: Call, prompt: list[int], s: Stream) -> None:
    s.start = time.perf_counter()
    call(prompt, s)
