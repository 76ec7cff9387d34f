"""The comparison's phases, one per system; each fills `rows[scenario key][system]`.

Every phase starts its own server, runs all its scenarios back to back, and stops the server by
PID in a `finally` (so only one system's processes use the CPUs at a time). A phase that fails
marks its rows {"error": ...} and the next phase still runs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from tgw.bench.compare_rows import Scenario, floor_row
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
    tgw_workers: int
    flask_workers: int
    floor_threads: int
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


def _fail_all(ctx: Ctx, rows: Rows, system: str, exc: BaseException) -> None:
    msg = f"{type(exc).__name__}: {exc}"
    ctx.log(f"{system} FAILED: {msg}")
    for sc in ctx.scenarios:
        rows[sc.key].setdefault(system, {"error": msg, "traceback": traceback.format_exc()})


def run_floors(ctx: Ctx, rows: Rows) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for model in dict.fromkeys(sc.model for sc in ctx.scenarios):
        m = ctx.models[model]
        inp = m["inputs"][0]
        shape = ",".join(str(16 if d == -1 else d) for d in inp["shape"])
        argv = [sys.executable, "-m", "tgw.bench.floor", "--path", m["path"], "--shape", shape,
                "--dtype", inp["dtype"], "--batches", f"1,{m['max_batch_size']}", "--seconds",
                str(ctx.floor_seconds), "--warmup", str(min(1.0, ctx.floor_seconds / 2)),
                "--threads", str(ctx.floor_threads)]
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=120 + 4 * ctx.floor_seconds)
            if proc.returncode != 0:
                raise RuntimeError(f"floor.py exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
            out[model] = json.loads(proc.stdout.strip().splitlines()[-1])
            row = floor_row(out[model])
            ctx.log(f"in-process floor {model}: batch 1 {row['floor']['batch1_samples_per_s']:,.0f} sps "
                    f"(p50 {row['latency_ms']['p50']:.3f} ms), batch {row['floor']['max_batch']} "
                    f"{row['throughput_rps']:,.0f} sps")
        except Exception as exc:  # noqa: BLE001 - record and go on
            row = {"error": f"{type(exc).__name__}: {exc}"}
            ctx.log(f"in-process floor {model} FAILED: {row['error']}")
        for sc in ctx.scenarios:
            if sc.model == model:
                rows[sc.key]["in-process"] = row
    return out


def run_transport(ctx: Ctx, rows: Rows, payloads: dict[str, int], replies: dict[str, int]) -> None:
    try:
        srv = EchoServer(ctx.work, ctx.work)
    except Exception as exc:  # noqa: BLE001
        _fail_all(ctx, rows, "transport", exc)
        return
    try:
        for sc in ctx.scenarios:
            target = ZmqEchoTarget(srv.front, payloads[sc.model], replies[sc.model])
            row = measure(target, _spec(ctx, sc), srv.processes, label=f"transport {sc.key}",
                          progress=ctx.progress)
            rows[sc.key]["transport"] = row
            ctx.log(f"transport floor {sc.key}: {_brief(row)}")
    except Exception as exc:  # noqa: BLE001
        _fail_all(ctx, rows, "transport", exc)
    finally:
        srv.stop()


def run_tgw(ctx: Ctx, rows: Rows) -> dict[str, Any]:
    from tgw.client import Client

    address = f"ipc://{ctx.work}/tgw.sock"
    names = list(dict.fromkeys(sc.model for sc in ctx.scenarios))
    cfg = write_config(os.path.join(ctx.work, "tgw.yaml"), address, ctx.models, names,
                       ["cpu"] * ctx.tgw_workers)
    info: dict[str, Any] = {"config": cfg}
    try:
        srv = TgwServer(address, cfg, os.path.join(ctx.work, "tgw-broker.log"))
    except Exception as exc:  # noqa: BLE001
        _fail_all(ctx, rows, "tgw", exc)
        return info
    try:
        processes = srv.processes()
        info["processes"] = processes
        with Client(address) as client:
            for sc in ctx.scenarios:
                target = TgwTarget(address, sc.model, timeout=60.0)
                row = measure(target, _spec(ctx, sc), processes, 1, stats_fn=client.stats, model=sc.model,
                              label=f"tgw {sc.key}", progress=ctx.progress)
                rows[sc.key]["tgw"] = row
                bs = row.get("broker_stats") or {}
                ctx.log(f"tgw native {sc.key}: {_brief(row)}, mean batch {bs.get('mean_batch_rows') or 0:.1f}")
    except Exception as exc:  # noqa: BLE001
        _fail_all(ctx, rows, "tgw", exc)
    finally:
        stop = srv.stop()
        info.update(stop)
        if stop["exit_status"] != 0 or stop["shm_leftovers"]:
            ctx.log(f"tgw broker stop: exit status {stop['exit_status']}, /dev/shm leftovers "
                    f"{stop['shm_leftovers']}")
    return info


def _flask_decl(models: dict[str, dict[str, Any]], names: list[str]) -> dict[str, dict]:
    return {n: {"path": models[n]["path"], "inputs": [i["name"] for i in models[n]["inputs"]],
                "dtypes": {i["name"]: i["dtype"] for i in models[n]["inputs"]}} for n in names}


def run_flask(ctx: Ctx, rows: Rows) -> dict[str, Any]:
    wrk = wrklib.ensure_wrk()
    info: dict[str, Any] = {"generator": f"wrk ({wrk})" if wrk else
                            "python fallback (wrk unavailable: keep-alive http.client, loadgen.py)"}
    if not wrk:
        ctx.log("wrk not found and not installable; using the Python HTTP generator (slower per request)")
    names = list(dict.fromkeys(sc.model for sc in ctx.scenarios))
    bodies = {}
    for n in names:
        bodies[n] = os.path.join(ctx.work, f"body-{n}.json")
        arrays = make_inputs(ctx.models[n], 1, seed=0)
        with open(bodies[n], "w") as f:
            json.dump({"inputs": {k: v.tolist() for k, v in arrays.items()}}, f)
    try:
        srv = FlaskServer(_flask_decl(ctx.models, names), ctx.flask_workers, os.path.join(ctx.work, "gunicorn.log"))
    except Exception as exc:  # noqa: BLE001
        _fail_all(ctx, rows, "flask", exc)
        return info
    try:
        for sc in ctx.scenarios:
            row = run_http(srv, sc.model, bodies[sc.model], sc.concurrency, ctx.duration, ctx.warmup, wrk,
                           os.path.join(ctx.work, "post.lua"))
            row["body_bytes"] = os.path.getsize(bodies[sc.model])
            rows[sc.key]["flask"] = row
            ctx.log(f"Flask+gunicorn {sc.key}: {_brief(row)} (JSON body {row['body_bytes']:,d} B)")
    except Exception as exc:  # noqa: BLE001
        _fail_all(ctx, rows, "flask", exc)
    finally:
        srv.stop()
    return info
