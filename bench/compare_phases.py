"""The comparison's work: the in-process floors (one subprocess per model), then the servers
(`Servers`) and one row per (scenario, system); everything fills `rows[scenario key][system]`.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import psutil

from tgw.bench.compare_rows import LABELS, Scenario, floor_row
from tgw.bench.flask_baseline import FlaskServer, run_http
from tgw.bench.inputs import make_inputs
from tgw.bench.loadgen import LoadSpec
from tgw.bench.runner import measure
from tgw.bench.targets import TgwTarget, ZmqEchoTarget
from tgw.bench.tgw_server import TgwServer, write_config
from tgw.bench.transport import EchoServer
from tgw.bench import wrk as wrklib

Rows = dict[str, dict[str, Any]]


@dataclass
class Ctx:
    work: str                         # temp dir: models, sockets, logs, bodies
    models: dict[str, dict[str, Any]]  # name -> {path, inputs, outputs, max_batch_size}
    scenarios: list[Scenario]
    duration: float
    warmup: float
    floor_seconds: float
    floor_rounds: int                 # full mode measures the floor before and after the servers
    tgw_workers: int
    flask_workers: int
    floor_procs: int                  # copies of the model, 1 torch thread each
    procs: int                        # generator processes (0: loadgen default)
    progress: bool | None
    log: Callable[[str], None]


def _spec(ctx: Ctx, sc: Scenario) -> LoadSpec:
    return LoadSpec("closed", sc.concurrency, ctx.duration, ctx.warmup, ctx.procs)


def _brief(row: dict[str, Any]) -> str:
    lat = row["latency_ms"]
    p50 = lat.get("p50")
    return (f"{row['throughput_rps']:,.0f} req/s, p50 {p50:.3f} ms" if p50 is not None
            else f"{row['throughput_rps']:,.0f} req/s") + (f", {row['requests_failed']} failed"
                                                           if row.get("requests_failed") else "")


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def floor_batches(max_batch: int) -> list[int]:
    """1, a quarter of the max and the max: per-sample cost is not monotonic in the batch size."""
    return sorted({1, max(1, max_batch // 4), max_batch})


def measure_floor(ctx: Ctx, model: str) -> dict[str, Any]:
    """floor.py for one model at floor_batches(), plus the background CPU meanwhile."""
    m = ctx.models[model]
    inp = m["inputs"][0]
    shape = ",".join(str(16 if d == -1 else d) for d in inp["shape"])
    argv = [sys.executable, "-m", "tgw.bench.floor", "--path", m["path"], "--shape", shape,
            "--dtype", inp["dtype"], "--batches", ",".join(str(b) for b in floor_batches(m["max_batch_size"])), "--seconds",
            str(ctx.floor_seconds), "--warmup", str(min(1.0, ctx.floor_seconds / 2)),
            "--procs", str(ctx.floor_procs)]
    machine0, child0, t0 = psutil.cpu_times(), _children_cpu(), time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120 + 4 * ctx.floor_seconds)
    machine1, child1, wall = psutil.cpu_times(), _children_cpu(), time.monotonic() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"floor.py exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    idle = machine1.idle - machine0.idle
    busy_cores = max(0.0, (sum(machine1) - sum(machine0) - idle) / wall) if wall > 0 else 0.0
    res["background_cpu_cores"] = max(0.0, busy_cores - (child1 - child0) / wall)
    return res


def best_floor(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Per batch size, the faster of two floor measurements (a limit is best estimated by the max)."""
    runs = {r["batch"]: r for r in a["runs"]}
    for r in b["runs"]:
        if r["batch"] not in runs or r["samples_per_s"] > runs[r["batch"]]["samples_per_s"]:
            runs[r["batch"]] = r
    bg = min(a.get("background_cpu_cores", 0), b.get("background_cpu_cores", 0))
    return {**a, "runs": [runs[k] for k in sorted(runs)], "rounds": a.get("rounds", 1) + 1,
            "background_cpu_cores": bg}


def run_floors(ctx: Ctx, previous: dict[str, Any] | None = None) -> dict[str, Any]:
    """model -> floor.py JSON (best of this and `previous`) or {"error": ...}."""
    out: dict[str, Any] = {}
    for model in dict.fromkeys(sc.model for sc in ctx.scenarios):
        try:
            res = measure_floor(ctx, model)
        except Exception as exc:  # noqa: BLE001 - record and go on
            out[model] = (previous or {}).get(model) or {"error": f"{type(exc).__name__}: {exc}"}
            ctx.log(f"in-process floor {model} FAILED: {type(exc).__name__}: {exc}")
            continue
        prev = (previous or {}).get(model)
        out[model] = best_floor(prev, res) if prev and "error" not in prev else res
        row = floor_row(res)  # this round's numbers; the row keeps the best of all rounds
        f = row["floor"]
        ctx.log(f"in-process floor {model}: batch 1 {f['batch1_samples_per_s']:,.0f} sps "
                f"(p50 {row['latency_ms']['p50']:.3f} ms), batch {f['max_batch']} "
                f"{f['max_batch_samples_per_s']:,.0f} sps; background load {res['background_cpu_cores']:.2f} cores")
    return out


def floor_rows(ctx: Ctx, floors: dict[str, Any], rows: Rows) -> None:
    for sc in ctx.scenarios:
        f = floors.get(sc.model)
        if f is not None:
            rows[sc.key]["in-process"] = f if "error" in f else floor_row(f)


class Servers:
    """Starts the transport echo, the tgw broker and gunicorn once, runs rows against them, and
    stops them all by PID on exit. Rows of one scenario run back to back across systems, so slow
    drifts of a shared machine's background load hit every system alike; idle servers sleep in
    poll/accept and take no CPU from the one being measured. A server that fails to start marks
    its rows {"error": ...}; the other systems still run."""

    def __init__(self, ctx: Ctx, systems: list[str], payloads: dict[str, int], replies: dict[str, int]):
        self.ctx, self.payloads, self.replies = ctx, payloads, replies
        self.systems = [s for s in ("transport", "tgw", "flask") if s in systems]
        self.failed: dict[str, BaseException] = {}
        self.info: dict[str, dict[str, Any]] = {"tgw": {}, "flask": {}}
        self.echo = self.tgw = self.flask = self.client = None
        self.wrk = None
        self.bodies: dict[str, str] = {}

    def __enter__(self) -> "Servers":
        for system in self.systems:
            try:
                getattr(self, f"_start_{system}")()
            except Exception as exc:  # noqa: BLE001 - the other systems still run
                self.failed[system] = exc
                self.ctx.log(f"{system} could not start: {type(exc).__name__}: {exc}")
        return self

    def __exit__(self, *exc) -> None:
        if self.client is not None:
            self.client.close()
        for name in ("echo", "flask"):
            srv = getattr(self, name)
            if srv is not None:
                srv.stop()
        if self.tgw is not None:
            stop = self.tgw.stop()
            self.info["tgw"].update(stop)
            if stop["exit_status"] != 0 or stop["shm_leftovers"]:
                self.ctx.log(f"tgw broker stop: exit status {stop['exit_status']}, /dev/shm leftovers "
                             f"{stop['shm_leftovers']}")

    def _start_transport(self) -> None:
        self.echo = EchoServer(self.ctx.work, self.ctx.work)

    def _start_tgw(self) -> None:
        from tgw.client import Client
        ctx = self.ctx
        address = f"ipc://{ctx.work}/tgw.sock"
        names = list(dict.fromkeys(sc.model for sc in ctx.scenarios))
        cfg = write_config(os.path.join(ctx.work, "tgw.yaml"), address, ctx.models, names, ["cpu"] * ctx.tgw_workers)
        self.info["tgw"]["config"] = cfg
        self.tgw = TgwServer(address, cfg, os.path.join(ctx.work, "tgw-broker.log"))
        self.info["tgw"]["processes"] = self.tgw.processes()
        self.client = Client(address)

    def _start_flask(self) -> None:
        ctx = self.ctx
        self.wrk = wrklib.ensure_wrk()
        self.info["flask"]["generator"] = (f"wrk ({self.wrk})" if self.wrk else
                                           "python fallback (wrk unavailable: keep-alive http.client, loadgen.py)")
        if not self.wrk:
            ctx.log("wrk not found and not installable; using the Python HTTP generator (slower per request)")
        names = list(dict.fromkeys(sc.model for sc in ctx.scenarios))
        for n in names:
            self.bodies[n] = os.path.join(ctx.work, f"body-{n}.json")
            arrays = make_inputs(ctx.models[n], 1, seed=0)
            with open(self.bodies[n], "w") as f:
                json.dump({"inputs": {k: v.tolist() for k, v in arrays.items()}}, f)
        self.flask = FlaskServer(_flask_decl(ctx.models, names), ctx.flask_workers,
                                 os.path.join(ctx.work, "gunicorn.log"))

    def run_scenario(self, sc: Scenario, rows: Rows) -> None:
        for system in self.systems:
            if system in self.failed:
                exc = self.failed[system]
                rows[sc.key][system] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            try:
                row = getattr(self, f"_row_{system}")(sc)
            except Exception as exc:  # noqa: BLE001 - record, go on with the next row
                row = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
                self.ctx.log(f"{LABELS[system]} {sc.key} FAILED: {row['error']}")
            else:
                self.ctx.log(f"{LABELS[system]} {sc.key}: {_brief(row)}")
            rows[sc.key][system] = row

    def _row_transport(self, sc: Scenario) -> dict[str, Any]:
        target = ZmqEchoTarget(self.echo.front, self.payloads[sc.model], self.replies[sc.model])
        return measure(target, _spec(self.ctx, sc), self.echo.processes, label=f"transport {sc.key}",
                       progress=self.ctx.progress)

    def _row_tgw(self, sc: Scenario) -> dict[str, Any]:
        target = TgwTarget(self.tgw.address, sc.model, timeout=60.0)
        row = measure(target, _spec(self.ctx, sc), self.info["tgw"]["processes"], 1, stats_fn=self.client.stats,
                      model=sc.model, label=f"tgw {sc.key}", progress=self.ctx.progress)
        return row

    def _row_flask(self, sc: Scenario) -> dict[str, Any]:
        row = run_http(self.flask, sc.model, self.bodies[sc.model], sc.concurrency, self.ctx.duration,
                       self.ctx.warmup, self.wrk, os.path.join(self.ctx.work, "post.lua"))
        row["body_bytes"] = os.path.getsize(self.bodies[sc.model])
        return row


def _flask_decl(models: dict[str, dict[str, Any]], names: list[str]) -> dict[str, dict]:
    return {n: {"path": models[n]["path"], "inputs": [i["name"] for i in models[n]["inputs"]],
                "dtypes": {i["name"]: i["dtype"] for i in models[n]["inputs"]}} for n in names}
