"""`tgw-bench gc-pauses`: the broker's garbage-collection pauses under load, `server.gc_freeze`
off and on in one run (a broker each, one after the other): mlp at 64 concurrent callers
(AsyncClient coroutines over the native socket; `--face grpc`: tritonclient's ModelInfer
over grpc.aio coroutines; `--face http`: the binary extension over keep-alive sockets, a
thread per caller) for 60 s each. Per setting: req/s, latency
p50/p99/p99.9/max, and from the broker's status `gc` (shm/gc_watch.py): its longest collection
pause while serving, its collections by generation and its pauses over 1 ms in the window, the
gen-0 collections per 1,000 requests, the worker's longest pause. The issue's goal: the longest
pause with the freeze <= 1 ms; p99.9 with and without. The freeze's own full collection (the
on row's `freeze_pause_ms`) is what one full collection of the start-up heap costs, the pause
the freeze takes off the table. Writes
bench/results/gc-pauses[-FACE]-<date>[-quick|-custom].json. Exit status 0 when every request was answered, 1
otherwise.

    tgw-bench gc-pauses --quick           # 16 callers, 3 s a setting: seconds, for the test
    tgw-bench gc-pauses                   # the full run bench/results/gc-pauses-*.json holds
    tgw-bench gc-pauses --face grpc       # the same through the gRPC face
    tgw-bench gc-pauses --duration 20 --only on
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional

from tgw.bench.harness import report
from tgw.bench.harness.loadgen import LoadSpec
from tgw.bench.harness.measure import measure
from tgw.bench.harness.targets import GrpcTarget, find_model, make_inputs, v2_body, v2_target
from tgw.testing.child import BrokerProc, exit_record, finish_run
from tgw.testing.demo import demo_models, tgw_config

NAME = "gc-pauses"
HELP = "the broker's longest GC pause and p99.9 at mlp c=64, server.gc_freeze off and on"
TARGET_MS = 1.0
SETTINGS = {"off": False, "on": True}
FACES = ("native", "grpc", "http")
DRIVERS = {"native": "AsyncClient coroutines, one client per generator process (the native socket only listens)",
           "grpc": "grpc.aio coroutines, a channel each, ModelInfer with raw_input_contents (the gRPC face only "
                   "listens besides the native socket)",
           "http": "a thread per caller, one keep-alive socket each, POST /v2/models/M/infer with the binary "
                   "extension (the HTTP face only listens besides the native socket)"}


@dataclass
class NativeAsyncTarget:
    """Closed-loop callers as coroutines on one AsyncClient per generator process (loadgen's
    `async_caller`): the leanest native client, so the generator takes little CPU from the broker."""
    address: str
    model: str
    meta: dict[str, Any]
    label: str = "tgw_native_async"
    clients: list = field(default_factory=list)

    def open(self, seed: int) -> "NativeAsyncTarget":
        self.seed = seed
        return self

    async def async_caller(self, index: int) -> Callable[[], Awaitable[None]]:
        from tgw.client import AsyncClient
        if not self.clients:
            client = AsyncClient(self.address)
            await client.connect()
            self.clients.append(client)
        client, model = self.clients[0], self.model
        inputs = make_inputs(self.meta, 1, self.seed * 1000 + index)
        await client.infer(model, inputs)   # one answer before the window: the caller works

        async def infer() -> None:
            await client.infer(model, inputs)
        return infer

    async def aclose(self) -> None:
        for client in self.clients:
            await client.close()

    def close(self) -> None:
        pass


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="16 callers, 3 s a setting (seconds)")
    p.add_argument("--duration", type=float, default=None, help="seconds of load per setting (default 60, quick 3)")
    p.add_argument("--concurrency", type=int, default=None, help="concurrent callers (default 64, quick 16)")
    p.add_argument("--warmup", type=float, default=None, help="seconds of load before the window (default 2, "
                                                               "quick 0.5)")
    p.add_argument("--model", default="mlp", help="a demo model (default mlp)")
    p.add_argument("--face", choices=FACES, default="native", help="the protocol the load comes in by (default "
                                                                   "native)")
    p.add_argument("--procs", type=int, default=1, help="generator processes (default 1: coroutines on one "
                                                         "AsyncClient each)")
    p.add_argument("--only", choices=sorted(SETTINGS), help="one setting of server.gc_freeze only")
    p.add_argument("--out", help="folder for results/ (default: bench/ of the checkout, else .)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder (models, logs, sockets)")


def window_gc(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """One process's collection figures over the window: collections by generation and pauses
    over 1 ms between two status snapshots; the longest pause while serving (it counts from the
    freeze, or from serving's start without it: warm-up and window, nothing of start-up)."""
    gens = {g: n - (before.get("collections") or {}).get(g, 0) for g, n in (after.get("collections") or {}).items()}
    return {"collections": gens, "pauses_over_1ms": after.get("pauses_over_1ms", 0) - before.get("pauses_over_1ms", 0),
            "longest_pause_ms": after.get("longest_pause_ms"), "longest_pause_cpu_ms": after.get("longest_pause_cpu_ms"),
            "frozen": after.get("frozen"),
            "frozen_objects": after.get("frozen_objects"), "freeze_pause_ms": after.get("freeze_pause_ms")}


def one_setting(a: argparse.Namespace, models: dict, setting: str, work: str, log: Callable[[str], None]) -> dict:
    from tgw.client import Client
    cfg = tgw_config(models, [a.model], 1)
    for face in ("http", "grpc"):   # only the face measured listens
        if face != a.face:
            cfg.pop(face)
    cfg["server"]["gc_freeze"] = SETTINGS[setting]
    d = os.path.join(work, setting)
    os.makedirs(d)
    broker = BrokerProc(cfg, d)
    row: dict[str, Any] = {"gc_freeze": SETTINGS[setting]}
    try:
        broker.start(timeout=180)
        with Client(broker.address) as c:
            meta = find_model(c.models(), a.model)
            snaps: list[dict] = []

            def stats() -> dict:   # measure() calls it at the window's edges: the gc figures beside
                s = c.stats()
                snaps.append(c.status()["gc"])
                return s
            log(f"gc_freeze {setting}: {a.concurrency} callers for {a.duration:g} s (+{a.warmup:g} s warm-up)")
            s = measure(target(a, broker.address, c.status(), meta, d),
                        LoadSpec("closed", a.concurrency, a.duration, a.warmup, a.procs), c.stats()["processes"],
                        stats=stats)
        before, after = snaps
        row.update({k: s.get(k) for k in ("throughput_rps", "requests_ok", "requests_failed", "errors",
                                          "error_messages", "latency_ms", "generator", "server_processes",
                                          "broker_stats", "machine", "warnings")})
        row["broker_gc"] = window_gc(before["broker"], after["broker"])
        row["workers_gc"] = {w: window_gc(before["workers"].get(w, {}), f) for w, f in after["workers"].items()}
        gen0 = row["broker_gc"]["collections"].get("0", 0)
        row["gen0_per_1000_requests"] = 1000 * gen0 / s["requests_ok"] if s["requests_ok"] else None
    finally:
        row["server"] = exit_record(broker)
    return row


def target(a: argparse.Namespace, address: str, status: dict, meta: dict, work: str) -> Any:
    """The callers of the face measured: native (AsyncClient), grpc (grpc.aio) or http (sockets)."""
    if a.face == "grpc":
        return GrpcTarget(status["grpc"], a.model, meta)
    if a.face == "http":
        body, header = v2_body(meta, binary=True)
        path = os.path.join(work, "body.bin")
        with open(path, "wb") as f:
            f.write(body)
        return v2_target(status["http"], a.model, path, header, True)
    return NativeAsyncTarget(address, a.model, meta)


def _f(v: Optional[float], fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def run(a: argparse.Namespace) -> int:
    mode = "quick" if a.quick else "full"
    a.duration = a.duration or (3.0 if a.quick else 60.0)
    a.concurrency = a.concurrency or (16 if a.quick else 64)
    a.warmup = (0.5 if a.quick else 2.0) if a.warmup is None else a.warmup
    if a.duration <= 0 or a.concurrency < 1 or a.warmup < 0 or a.procs < 1:
        print("tgw-bench gc-pauses: --duration must be > 0, --concurrency and --procs >= 1, --warmup >= 0",
              file=sys.stderr)
        return 2
    if (a.duration, a.concurrency, a.warmup) != ((3.0, 16, 0.5) if a.quick else (60.0, 64, 2.0)) or a.only:
        mode = "custom"
    log = lambda msg: print(f"[gc-pauses {time.strftime('%H:%M:%S')}] {msg}", flush=True)  # noqa: E731
    work = tempfile.mkdtemp(prefix="tgwgc-", dir="/tmp")   # ipc paths must stay under 107 bytes
    t0, date = time.monotonic(), datetime.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    res: dict[str, Any] = {"scenario": NAME, "mode": mode, "date": date, "command": a.command_line,
                           "machine": report.machine(), "rows": {},
                           "settings": {"model": a.model, "concurrency": a.concurrency, "duration_s": a.duration,
                                        "warmup_s": a.warmup, "generator_procs": a.procs, "workers": 1,
                                        "face": a.face, "driver": DRIVERS[a.face]}}
    try:
        models = demo_models(os.path.join(work, "models"))
        if a.model not in models:
            print(f"tgw-bench gc-pauses: unknown model {a.model!r}; choose from {', '.join(models)}", file=sys.stderr)
            return 2
        for setting in [a.only] if a.only else list(SETTINGS):
            res["rows"][setting] = row = one_setting(a, models, setting, work, log)
            g = row["broker_gc"]
            log(f"gc_freeze {setting}: {_f(row['throughput_rps'], ',.0f')} req/s, p99.9 "
                f"{_f(row['latency_ms']['p99_9'], '.2f')} ms; broker's longest pause "
                f"{_f(g['longest_pause_ms'], '.3f')} ms, collections {g['collections']}, "
                f"{g['pauses_over_1ms']} over 1 ms")
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every server this run started", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - recorded
        res["error"] = f"{type(exc).__name__}: {exc}"
        log(f"FAILED: {res['error']}")
    finally:
        finish_run(work, a.keep)
    return conclude(res, a, date, mode, t0)


def conclude(res: dict, a: argparse.Namespace, date: str, mode: str, t0: float) -> int:
    rows = res["rows"]
    on, off = rows.get("on"), rows.get("off")
    longest = on["broker_gc"]["longest_pause_ms"] if on else None
    cpu = on["broker_gc"].get("longest_pause_cpu_ms") if on else None
    tail = lambda r: r["latency_ms"]["p99_9"] if r else None  # noqa: E731
    res["goals"] = [
        {"goal": f"the broker's longest GC pause while serving, gc_freeze on, c={a.concurrency} for {a.duration:g} s",
         "value": longest, "target": TARGET_MS, "unit": "ms", "met": None if longest is None else longest <= TARGET_MS},
        {"goal": "... the longest in the collecting thread's CPU time (without the time a busy box ran others)",
         "value": cpu, "target": TARGET_MS, "unit": "ms", "met": None if cpu is None else cpu <= TARGET_MS},
        {"goal": "p99.9 latency, gc_freeze off / on (reported, no target)",
         "value": tail(off) / tail(on) if tail(off) and tail(on) else None, "target": None, "unit": "x", "met": None}]
    body = [["gc_freeze", "req/s", "p50 ms", "p99 ms", "p99.9 ms", "max ms", "longest pause ms", "its CPU ms", "gen0", "gen1",
             "gen2", ">1 ms", "gen0/1k req", "worker longest ms", "freeze's full gc ms"]]
    for setting, r in rows.items():
        lat, g = r["latency_ms"], r["broker_gc"]
        worker = max((w.get("longest_pause_ms") or 0 for w in r["workers_gc"].values()), default=None)
        body.append([setting, _f(r["throughput_rps"], ",.0f"), *(_f(lat[k], ".2f") for k in ("p50", "p99", "p99_9", "max")),
                     _f(g["longest_pause_ms"], ".3f"), _f(g.get("longest_pause_cpu_ms"), ".3f"),
                     *(str(g["collections"].get(k, 0)) for k in "012"),
                     str(g["pauses_over_1ms"]), _f(r["gen0_per_1000_requests"], ".1f"), _f(worker, ".3f"),
                     _f(g.get("freeze_pause_ms") if g["frozen"] else None, ".1f")])
    goals = [["goal", "value", "target", "met"]] + [
        [x["goal"], _f(x["value"], ".3f" if x["unit"] == "ms" else ".2f"), "-" if x["target"] is None else str(x["target"]),
         {True: "yes", False: "NO", None: "-"}[x["met"]]] for x in res["goals"]]
    report.conclude(res, "gc-pauses" if a.face == "native" else f"gc-pauses-{a.face}", a.out, date, mode, t0,
                    report.text_table(body) + "\n\n" + report.text_table(goals))
    complete = "error" not in res and rows and all(
        r["requests_failed"] == 0 and r["requests_ok"] > 0 and r["server"]["exit_status"] == 0 for r in rows.values())
    return 0 if complete else 1
