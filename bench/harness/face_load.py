"""The load and the CPU accounting of `tgw-bench faces` (issue 43's face costs): what each face's
client sends at c=64, and where the broker's CPU goes meanwhile.

Clients, each a loadgen target (targets.py's contract) whose callers are coroutines on ONE asyncio
loop per generator process (loadgen's `async_caller`), so the client's CPU per request is one
process's:

* `NativeTarget`: tgw's AsyncClient, one connection, every caller's request on it;
* `GrpcUnaryTarget`: the generated KServe v2 stub's method over grpc.aio on ONE channel (as one
  tritonclient InferenceServerClient is one channel), bytes in and out: tritonclient.grpc.aio's
  own Python (InferInput objects, InferResult parsing) would be measured with the broker, so the
  leaner stub is used - the request is serialized once per caller, a reply read to its status;
* `TritonAioTarget` (a face asked for by name only): tritonclient.grpc.aio's own `infer` on one
  client, to show what its Python costs the caller beside the stub;
* `GrpcStreamTarget`: ONE ModelStreamInfer stream with every caller's request in flight on it,
  matched to its answer by request id (a writer task sends, a reader task answers the callers).

`CpuWatch` reads, at the window's edges, the broker's scheduler loop (the broker's main thread:
/proc/<pid>/task/<pid>/stat, utime + stime; ZeroMQ's I/O threads, the gRPC poller and the others
excluded), the broker process, each front process (their pids from status `fronts.lives`, or
stats' processes of role "front") and the workers.
"""
from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable, Optional

from tgw.bench.harness.targets import (STREAM, CallError, GrpcTarget, find_model, infer_request, make_inputs)

TICK = os.sysconf("SC_CLK_TCK")


# ---- the clients ------------------------------------------------------------------------------

@dataclass
class NativeTarget:
    address: str
    model: str
    timeout: float = 60.0
    label: str = "native"

    def open(self, seed: int) -> "NativeTarget":
        self.seed, self.client = seed, None
        return self

    async def async_caller(self, index: int) -> Callable[[], Awaitable[Any]]:
        from tgw.client import AsyncClient
        if self.client is None:   # one connection for every caller of this process
            self.client = AsyncClient(self.address)
            await self.client.connect()
            self.meta = find_model(await self.client.models(), self.model)
        inputs = make_inputs(self.meta, 1, self.seed * 1000 + index)
        infer, model, timeout = self.client.infer, self.model, self.timeout
        out = await infer(model, inputs, timeout=timeout)   # one answer checked before the window
        wanted = sorted(o["name"] for o in self.meta["outputs"])
        if sorted(out) != wanted:
            raise CallError("BAD_REPLY", f"outputs {sorted(out)}, declared {wanted}")
        return lambda: infer(model, inputs, timeout=timeout)

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.close()

    def close(self) -> None:
        pass


@dataclass
class GrpcUnaryTarget(GrpcTarget):
    label: str = "grpc"

    def channel(self):
        if not self.channels:   # one channel (one HTTP/2 connection) for every caller
            super().channel()
        return self.channels[0]


@dataclass
class GrpcStreamTarget(GrpcTarget):
    label: str = "grpc-stream"

    async def async_caller(self, index: int) -> Callable[[], Awaitable[None]]:
        if not hasattr(self, "waiting"):
            await self._start()
        loop, waiting, send = asyncio.get_running_loop(), self.waiting, self.sends.put_nowait
        rid = f"c{index}"
        body = infer_request(self.model, make_inputs(self.meta, 1, self.seed * 1000 + index))
        body.id = rid
        body = body.SerializeToString()

        async def infer() -> None:
            fut = waiting[rid] = loop.create_future()
            send(body)
            answer = await asyncio.wait_for(fut, self.timeout)
            if answer.error_message:
                raise CallError("STREAM_ERROR", answer.error_message)
        await infer()   # each caller answered once before the window
        return infer

    async def _start(self) -> None:
        """The stream, its writer and reader tasks, and one answer checked in full."""
        from tgw.broker.faces.grpc.proto import grpc_service_pb2 as pb
        self.waiting: dict[str, asyncio.Future] = {}
        self.sends: asyncio.Queue = asyncio.Queue()
        self.stream = self.channel().stream_stream(STREAM)()   # bytes both ways
        check = infer_request(self.model, make_inputs(self.meta, 1, self.seed))
        check.id = "check"
        await self.stream.write(check.SerializeToString())
        first = pb.ModelStreamInferResponse.FromString(await self.stream.read())
        if first.error_message:
            raise CallError("STREAM_ERROR", first.error_message)
        self.check(first.infer_response.SerializeToString())
        self.tasks = [asyncio.ensure_future(self._write()), asyncio.ensure_future(self._read(pb))]

    async def _write(self) -> None:
        while True:
            await self.stream.write(await self.sends.get())

    async def _read(self, pb) -> None:
        import grpc
        try:
            while True:
                raw = await self.stream.read()
                if raw is grpc.aio.EOF:
                    raise CallError("STREAM_ENDED", "the server ended the stream")
                answer = pb.ModelStreamInferResponse.FromString(raw)
                fut = self.waiting.pop(answer.infer_response.id, None)
                if fut is not None and not fut.done():
                    fut.set_result(answer)
        except Exception as exc:  # noqa: BLE001 - every waiting caller fails with it
            err = exc if isinstance(exc, CallError) else CallError(type(exc).__name__, str(exc)[:200])
            for fut in self.waiting.values():
                if not fut.done():
                    fut.set_exception(err)
            self.waiting.clear()

    async def aclose(self) -> None:
        for t in getattr(self, "tasks", []):
            t.cancel()
        if hasattr(self, "stream"):
            try:
                await self.stream.done_writing()
            except Exception:  # noqa: BLE001 - the channel's close ends it anyway
                pass
        await super().aclose()


@dataclass
class TritonAioTarget:
    """tritonclient.grpc.aio's `infer`, every caller on one InferenceServerClient (one channel): what
    a Triton user's Python client pays per call beside the bare stub (GrpcUnaryTarget)."""
    address: str
    model: str
    meta: dict[str, Any]
    timeout: float = 60.0
    label: str = "grpc-tritonclient"

    def open(self, seed: int) -> "TritonAioTarget":
        self.seed, self.client = seed, None
        return self

    async def async_caller(self, index: int) -> Callable[[], Awaitable[None]]:
        import tritonclient.grpc.aio as ga
        from tgw.bench.harness.targets import v2_datatype
        if self.client is None:
            self.client = ga.InferenceServerClient(self.address)
        inputs = []
        for name, x in make_inputs(self.meta, 1, self.seed * 1000 + index).items():
            inputs.append(ga.InferInput(name, list(x.shape), v2_datatype(x.dtype)))
            inputs[-1].set_data_from_numpy(x)
        outputs = [ga.InferRequestedOutput(o["name"]) for o in self.meta["outputs"]]
        client, model, timeout = self.client, self.model, self.timeout

        async def infer() -> None:
            await client.infer(model, inputs, outputs=outputs, client_timeout=timeout)
        result = await client.infer(model, inputs, outputs=outputs, client_timeout=timeout)
        for o in self.meta["outputs"]:   # one answer checked before the window
            if result.as_numpy(o["name"]) is None:
                raise CallError("BAD_REPLY", f"no output {o['name']}")
        return infer

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.close()

    def close(self) -> None:
        pass


# ---- where the broker's CPU goes --------------------------------------------------------------

def thread_cpu_s(pid: int, tid: int) -> Optional[float]:
    """One thread's user + system CPU seconds (/proc/<pid>/task/<tid>/stat), None when gone."""
    try:
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICK   # fields 14 and 15 of stat(5)


def process_cpu_s(pid: int) -> Optional[float]:
    """A whole process's user + system CPU seconds, every thread (/proc/<pid>/stat)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICK


def front_pids(status: dict[str, Any], stats: Optional[dict[str, Any]] = None) -> list[int]:
    """The live front processes' pids: status `fronts.lives` (each life with its pid, and `hello`
    once it said hello), else stats' processes of role "front"; [] when the broker runs none."""
    lives = (status.get("fronts") or {}).get("lives") if isinstance(status.get("fronts"), dict) else None
    items: Iterable[Any] = (lives.values() if isinstance(lives, dict) else lives) or []
    pids = [int(x["pid"]) for x in items if isinstance(x, dict) and x.get("pid") and x.get("hello", True)]
    if not pids and stats:
        pids = [int(p["pid"]) for p in stats.get("processes", []) if p.get("role") == "front" and p.get("pid")]
    return sorted(set(pids))


def front_counts(status: dict[str, Any]) -> dict[str, int]:
    """The fronts' own counters summed over their lives (status `fronts.lives`, each front's STATS,
    about once a second): requests handled, of which forwarded to the broker's own faces."""
    lives = (status.get("fronts") or {}).get("lives") or []
    return {k: sum(int(x.get(k) or 0) for x in lives if isinstance(x, dict)) for k in ("requests", "forwarded")}


class CpuWatch:
    """CPU seconds at the window's edges: the broker's main thread (the scheduler loop), the broker
    process, the front processes and the workers; `report(requests)` turns them into µs per request.
    `status`: the broker's status call, for the fronts' counters across the window (read outside
    the CPU readings: its RPC is not charged to the faces)."""

    def __init__(self, broker_pid: int, fronts: list[int], workers: list[int],
                 status: Optional[Callable[[], dict]] = None):
        self.broker, self.fronts, self.workers, self.status = broker_pid, list(fronts), list(workers), status
        self.edges: list[dict[str, Any]] = []
        self.counts: list[dict[str, int]] = []

    def edge(self) -> None:
        start = not self.edges
        if start and self.status and self.fronts:
            self.counts.append(front_counts(self.status()))
        self.edges.append({"loop": thread_cpu_s(self.broker, self.broker), "broker": process_cpu_s(self.broker),
                           "fronts": [process_cpu_s(p) for p in self.fronts],
                           "workers": [process_cpu_s(p) for p in self.workers]})
        if not start and self.status and self.fronts:
            self.counts.append(front_counts(self.status()))

    def report(self, requests: int) -> dict[str, Any]:
        a, b = self.edges[0], self.edges[-1]

        def used(x, y) -> Optional[float]:
            return None if x is None or y is None else y - x

        def total(xs, ys) -> Optional[float]:
            got = [used(x, y) for x, y in zip(xs, ys)]
            return None if any(g is None for g in got) else sum(got)   # a front gone mid-window: unknown
        cpu = {"loop": used(a["loop"], b["loop"]), "broker": used(a["broker"], b["broker"]),
               "fronts": total(a["fronts"], b["fronts"]), "workers": total(a["workers"], b["workers"])}
        cpu["broker_other_threads"] = None if None in (cpu["loop"], cpu["broker"]) else cpu["broker"] - cpu["loop"]
        cpu["tree"] = None if None in (cpu["broker"], cpu["fronts"]) else cpu["broker"] + cpu["fronts"]
        per = {k: (None if v is None or requests <= 0 else round(v / requests * 1e6, 2)) for k, v in cpu.items()}
        out = {"cpu_s": {k: v if v is None else round(v, 3) for k, v in cpu.items()}, "us_per_request": per,
               "front_pids": self.fronts}
        if len(self.counts) == 2:   # the fronts' STATS come about once a second: about the window's
            out["fronts_counted"] = {k: self.counts[1][k] - self.counts[0][k] for k in self.counts[0]}
        return out


def predicts(loop_us: Optional[float], front_us: Optional[float],
             counts=(1, 2, 4, 8, 16)) -> dict[str, Optional[float]]:
    """The req/s N fronts would allow, each on a core of its own: 1e6 / max(loop µs, front µs / N)
    (the scheduler loop stays one; the fronts' CPU per request spreads over N)."""
    if not loop_us:
        return {str(n): None for n in counts}
    return {str(n): round(1e6 / max(loop_us, (front_us or 0.0) / n)) for n in counts}
