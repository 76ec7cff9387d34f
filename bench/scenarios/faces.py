"""`tgw-bench faces`: what each face costs the broker (issue 43), mlp at c=64 over native
(AsyncClient), HTTP binary (wrk), unary gRPC (the KServe stub over grpc.aio, one channel) and a
gRPC stream (all requests in flight on ONE ModelStreamInfer stream), in rounds, once per
front-process count: req/s, p50/p99, rows per batch, the broker tree's CPU per request (broker and front
processes), the scheduler loop's own (the broker's main thread), the client's; then c=1 p50 of
native and of HTTP under wrk against Flask + gunicorn; the ratios and goals of the same run, and
the req/s the measured CPU predicts with N fronts on N cores. Writes
bench/results/faces-<date>[-quick|-custom].json (or --json FILE). Exit status 0 when every row was
filled without a failed request and every broker stopped cleanly (goals missed are reported
only), 1 otherwise, 130 when interrupted.

    tgw-bench faces --quick                        # seconds per row: development, the test
    tgw-bench faces --fronts 0,2                   # the full run bench/results/faces-*.json holds
    tgw-bench faces --fronts 0,1,2,4,8 --no-c1 --rounds 1 --duration 2 --procs 4   # the GPU box's sweep
"""
from __future__ import annotations

import argparse
import datetime
import functools
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

from tgw.bench.harness import face_load, report, subset
from tgw.bench.harness.loadgen import LoadSpec
from tgw.bench.harness.measure import loadgen_drive, measure
from tgw.bench.harness.targets import TgwTarget, v2_body, v2_target
from tgw.bench.harness.wrk import WRK_INSTALL_HINT, wrk_drive
from tgw.testing.child import BrokerProc, exit_record, finish_run
from tgw.testing.demo import demo_models, tgw_config

NAME = "faces"
HELP = "each face's cost at mlp c=64 (native, HTTP binary, gRPC unary, gRPC stream) with 0..N front processes"
FACES = ("native", "http", "grpc", "grpc-stream")
EXTRA_FACES = ("grpc-tritonclient",)   # only when named: tritonclient.grpc.aio's own infer (its client cost)
MODEL = "mlp"
MODES = {"quick": (1.0, 0.5, 1), "full": (8.0, 2.0, 3)}   # measured seconds, warm-up seconds per row, rounds
FRONTS_TIMEOUT_S = 60.0
# issue 43's goals: (name, the figure, ≥ or ≤, target)
GOALS = (("grpc_over_http_bin", "≥", 1.0), ("grpc_stream_over_http_bin", "≥", 1.2),
         ("http_bin_over_native", "≥", 0.9), ("loop_us_per_request_max", "≤", 25.0),
         ("native_client_us_per_request", "≤", 50.0), ("native_c1_p50_over_flask", "≤", 0.6),
         ("http_wrk_c1_p50_over_flask_wrk", "≤", 1.0))


def _counts(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 0:
        raise argparse.ArgumentTypeError(f"expected front-process counts >= 0 separated by commas, got {text!r}")
    return list(dict.fromkeys(vals))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help=f"{MODES['quick'][0]:g} s per row (development, the test)")
    p.add_argument("--fronts", type=_counts, default=[0, 2],
                   help="server.front_processes of the brokers started, one broker each (default 0,2)")
    p.add_argument("--faces", default=list(FACES), type=subset(FACES + EXTRA_FACES),
                   help=f"comma-separated subset of {','.join(FACES + EXTRA_FACES)} (default: {','.join(FACES)})")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight per c=N row (default 64)")
    p.add_argument("--duration", type=float, help="measured seconds per row (default 8, quick 1)")
    p.add_argument("--warmup", type=float, help="warm-up seconds per row (default 2, quick 0.5)")
    p.add_argument("--rounds", type=int, help="rounds over the c=N faces, each starting at the next face; each "
                                              "face's best row kept, ratios the median of the rounds' (default 3, "
                                              "quick 1)")
    p.add_argument("--no-c1", action="store_true", help="skip the c=1 rows and Flask (the GPU box's sweep)")
    cores = os.cpu_count() or 1
    p.add_argument("--workers", type=int, default=min(2, cores), help="tgw cpu workers (default min(2, cores))")
    p.add_argument("--flask-workers", type=int, default=cores, help=f"gunicorn sync workers (default cores = {cores})")
    p.add_argument("--procs", type=int, default=1,
                   help="generator processes of the c=N rows (default 1: the client's CPU is one process's)")
    p.add_argument("--out", help="folder for results/ (default: bench/ of the checkout, else .)")
    p.add_argument("--json", metavar="FILE", help="write the result here instead of results/faces-<date>.json")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder (models, logs, sockets)")
    p.add_argument("--note", action="append", default=[], help="a line for the result's notes (repeatable)")


class Broker:
    """One broker with `fronts` front processes, its faces' addresses, its processes' pids."""

    def __init__(self, a: argparse.Namespace, work: str, models: dict, fronts: int, log: Callable[[str], None]):
        from tgw.client import Client
        cfg = tgw_config(models, [MODEL], a.workers)
        cfg["server"]["front_processes"] = fronts
        self.dir = os.path.join(work, f"f{fronts}")
        os.makedirs(self.dir)
        self.proc = BrokerProc(cfg, self.dir)
        self.client = Client(self.proc.start(timeout=180).address)
        self.fronts, self.note = self._wait_fronts(fronts), None
        status = self.client.status()
        # with fronts, the public ports are theirs (the broker's own faces listen on Unix sockets)
        public = (status.get("fronts") or {}).get("public") or {}
        self.http, self.grpc = public.get("http") or status["http"], public.get("grpc") or status["grpc"]
        if len(self.fronts) != fronts:
            self.note = (f"asked for {fronts} front processes, status shows {len(self.fronts)}"
                         + ("" if "fronts" in status else " (this build's status has no fronts section)"))
            log(self.note)
        self.workers = [p["pid"] for p in self.client.stats()["processes"] if p.get("role") == "worker"]

    def _wait_fronts(self, n: int) -> list[int]:
        """The front pids once status counts n of them (a build without fronts: at once, none)."""
        deadline = time.monotonic() + FRONTS_TIMEOUT_S
        while True:
            status = self.client.status()
            pids = face_load.front_pids(status, self.client.stats())
            if len(pids) >= n or "fronts" not in status or time.monotonic() > deadline:
                return pids
            time.sleep(0.2)

    def stop(self) -> dict[str, Any]:
        self.client.close()
        return exit_record(self.proc)


def watched(drive: Callable[..., dict], watch: face_load.CpuWatch) -> Callable[..., dict]:
    """`drive` with the CPU watch read inside measure()'s window edges (after its stats() call at
    the start, before it at the end: the stats RPC is not charged to the faces)."""
    def run(target, spec, on_window_start, on_window_end):
        def start() -> None:
            on_window_start()
            watch.edge()

        def end() -> None:
            watch.edge()
            on_window_end()
        return drive(target, spec, on_window_start=start, on_window_end=end)
    return run


class Rows:
    """The run's shared pieces (models, bodies, wrk) and one measured row at a time."""

    def __init__(self, a: argparse.Namespace, work: str, models: dict, log: Callable[[str], None]):
        self.a, self.work, self.models, self.log = a, work, models, log
        self.wrk = shutil.which("wrk")
        self.http_generator = f"wrk ({self.wrk})" if self.wrk else \
            "python fallback (wrk not installed: keep-alive HTTP/1.1 sockets through loadgen.py)"
        if not self.wrk:
            log(WRK_INSTALL_HINT)
        self.bodies = {}
        for binary in (False, True):
            body, header = v2_body(models[MODEL], binary)
            path = os.path.join(work, f"body.{'bin' if binary else 'json'}")
            with open(path, "wb") as f:
                f.write(body)
            self.bodies[binary] = path, header

    def http_drive(self) -> Callable[..., dict]:
        return functools.partial(wrk_drive, self.wrk) if self.wrk else \
            functools.partial(loadgen_drive, kind="python-fallback")

    def spec(self, level: int) -> LoadSpec:
        return LoadSpec("closed", level, self.a.duration, self.a.warmup, self.a.procs if level > 1 else 1)

    def face(self, b: Broker, face: str, level: int) -> dict[str, Any]:
        m = self.models[MODEL]
        if face == "native":
            target, drive = face_load.NativeTarget(b.proc.address, MODEL), loadgen_drive
        elif face in ("grpc", "grpc-stream", "grpc-tritonclient"):
            cls = {"grpc": face_load.GrpcUnaryTarget, "grpc-stream": face_load.GrpcStreamTarget,
                   "grpc-tritonclient": face_load.TritonAioTarget}[face]
            target, drive = cls(b.grpc, MODEL, m, timeout=60.0), loadgen_drive
        elif face == "native-c1":   # one Python client thread, the synchronous Client
            target, drive = TgwTarget(b.proc.address, MODEL, timeout=60.0, label=face), loadgen_drive
        else:   # http (binary, c=N) or http-c1 (JSON, the body Flask gets)
            binary = face == "http"
            target = v2_target(b.http, MODEL, *self.bodies[binary], binary, face)
            drive = self.http_drive()
        return self.measured(face, target, drive, level, b)

    def flask(self, srv, face: str) -> dict[str, Any]:
        target = v2_target(f"http://127.0.0.1:{srv.port}", MODEL, *self.bodies[False], False, face)
        drive = self.http_drive() if face == "flask-c1-wrk" else loadgen_drive   # flask-c1: one Python thread
        return self.measured(face, target, drive, 1, None, srv.processes)

    def measured(self, name: str, target, drive, level: int, b: Optional[Broker],
                 processes: Optional[list] = None) -> dict[str, Any]:
        """One row; a failure is recorded as {"error": ...} and the run goes on."""
        try:
            if b is None:
                row = measure(target, self.spec(level), processes, drive=drive)
            else:
                watch = face_load.CpuWatch(b.proc.pid, b.fronts, b.workers, b.client.status)
                row = measure(target, self.spec(level), b.client.stats()["processes"], stats=b.client.stats,
                              drive=watched(drive, watch))
                row["cpu"] = watch.report(row["requests_ok"] + row["requests_failed"])
        except Exception as exc:  # noqa: BLE001 - the other rows still run
            self.log(f"{name} c={level} FAILED: {type(exc).__name__}: {exc}")
            return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        self.log(f"{name} c={level}: " + ", ".join(line(row)))
        return row


def figures(row: dict[str, Any]) -> dict[str, Optional[float]]:
    """A row's headline figures (None where it failed or a figure is unknown)."""
    if not row or "error" in row:
        return dict.fromkeys(("rps", "p50", "p99", "rows_per_batch", "loop_us_per_batch", "tree_us", "loop_us",
                              "front_us",
                              "broker_other_us", "client_us"))
    us = (row.get("cpu") or {}).get("us_per_request") or {}
    loop_s = ((row.get("cpu") or {}).get("cpu_s") or {}).get("loop")
    batches = (row.get("broker_stats") or {}).get("batches")
    return {"rps": row["throughput_rps"], "p50": row["latency_ms"]["p50"], "p99": row["latency_ms"]["p99"],
            "rows_per_batch": (row.get("broker_stats") or {}).get("mean_batch_rows"),
            # the loop's cost follows the batches it forms as much as the requests (each batch's dispatch, answer)
            "loop_us_per_batch": None if loop_s is None or not batches else round(loop_s / batches * 1e6, 1),
            "tree_us": us.get("tree"), "loop_us": us.get("loop"), "front_us": us.get("fronts"),
            "broker_other_us": us.get("broker_other_threads"),
            "client_us": (row.get("cpu_us_per_request") or {}).get("generator")}


def line(row: dict[str, Any]) -> list[str]:
    f = figures(row)
    parts = [f"{f['rps']:,.0f} req/s"]
    for key, unit in (("p50", "ms p50"), ("rows_per_batch", "rows/batch"), ("tree_us", "us/req tree"),
                      ("loop_us", "us/req loop"), ("front_us", "us/req fronts"), ("client_us", "us/req client")):
        if f[key] is not None:
            parts.append(f"{f[key]:.3g} {unit}")
    if row["requests_failed"]:
        parts.append(f"{row['requests_failed']} failed {row['errors']}")
    return parts


def _ratio(x: Optional[float], y: Optional[float]) -> Optional[float]:
    return None if x is None or not y else x / y


def best(old: Optional[dict], new: dict) -> dict:
    """The row kept of a face over rounds: the one with more req/s (a failed one only if all failed)."""
    if old is None or "error" in old:
        return new
    return new if "error" not in new and new["throughput_rps"] > old["throughput_rps"] else old


def round_ratio(block: dict[str, Any], a: str, b: str) -> Optional[float]:
    """a's req/s over b's: the median over rounds of each round's ratio (in a round the faces ran
    back to back, so a ratio pairs rows the box's load met alike; best rows of rounds apart would not)."""
    got = [_ratio(r[a]["rps"], r[b]["rps"]) for r in block.get("rounds", []) if a in r and b in r]
    got = [x for x in got if x is not None]
    return statistics.median(got) if got else None


def block_figures(block: dict[str, Any]) -> dict[str, Any]:
    """One front count's ratios (same run), the worst loop and client µs/req over its c=N faces,
    and per face the req/s its CPU predicts with N fronts on N cores."""
    f = {face: figures(row) for face, row in block["rows"].items()}
    p50 = lambda face: (f.get(face) or {}).get("p50")   # noqa: E731
    loops = [v["loop_us"] for k, v in f.items() if k in FACES + EXTRA_FACES and v["loop_us"] is not None]
    ratios = {"grpc_over_http_bin": round_ratio(block, "grpc", "http"),
              "grpc_stream_over_http_bin": round_ratio(block, "grpc-stream", "http"),
              "http_bin_over_native": round_ratio(block, "http", "native"),
              "loop_us_per_request_max": max(loops) if loops else None,
              # tgw's own client (issue 27's goal); the gRPC clients' CPU is grpc.aio's, in each row
              "native_client_us_per_request": (f.get("native") or {}).get("client_us"),
              "native_c1_p50_over_flask": _ratio(p50("native-c1"), p50("flask-c1")),
              "http_wrk_c1_p50_over_flask_wrk": _ratio(p50("http-c1"), p50("flask-c1-wrk"))}
    predicted = {face: {"loop_us": v["loop_us"], "front_us": v["front_us"],
                        "req_per_s_with_n_fronts": face_load.predicts(v["loop_us"], v["front_us"])}
                 for face, v in f.items() if face in FACES + EXTRA_FACES}
    return {"ratios": ratios, "predicts": predicted}


def goals(blocks: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for fronts, block in blocks.items():
        for name, op, target in GOALS:
            v = block["ratios"].get(name)
            met = None if v is None else (v >= target if op == "≥" else v <= target)
            out.append({"goal": name, "fronts": int(fronts), "value": v, "op": op, "target": target, "met": met})
    return out


def table(blocks: dict[str, dict[str, Any]]) -> str:
    rows = [["fronts", "face", "req/s", "p50 ms", "p99 ms", "rows/batch", "tree us/req", "loop us/req",
             "fronts us/req", "client us/req"]]
    fmt = lambda v, d: "-" if v is None else f"{v:,.{d}f}"   # noqa: E731
    for fronts, block in blocks.items():
        for face, row in block["rows"].items():
            f = figures(row)
            label = f"{face} (FAILED)" if "error" in row else \
                f"{face} (python-fallback)" if row["generator"]["kind"] == "python-fallback" else face
            rows.append([fronts, label, fmt(f["rps"], 0),
                         fmt(f["p50"], 3), fmt(f["p99"], 3), fmt(f["rows_per_batch"], 1), fmt(f["tree_us"], 1),
                         fmt(f["loop_us"], 1), fmt(f["front_us"], 1), fmt(f["client_us"], 1)])
    return report.text_table(rows, 2)


def predicts_lines(blocks: dict[str, dict[str, Any]], cores: int) -> list[str]:
    lines = [f"predicts (this box has {cores} cores" + (": fronts cannot show scaling here, so the CPU per request "
                                                        "stands in for it" if cores < 8 else "") +
             "): req/s = 1e6 / max(loop us, fronts us / N) with N fronts each on a core"]
    for fronts, block in blocks.items():
        if int(fronts) == 0:
            continue
        for face, p in block["predicts"].items():
            if p["loop_us"] is not None:
                got = ", ".join(f"N={n}: {v:,}" for n, v in p["req_per_s_with_n_fronts"].items() if v)
                lines.append(f"  fronts={fronts} {face}: loop {p['loop_us']:.1f} us, fronts "
                             f"{p['front_us'] or 0:.1f} us per request -> {got}")
    return lines


def run(a: argparse.Namespace) -> int:
    base = MODES["quick" if a.quick else "full"]
    custom = (a.duration, a.warmup, a.rounds) != (None, None, None) or a.no_c1 or a.fronts != [0, 2] \
        or a.faces != list(FACES) or a.concurrency != 64
    mode = "custom" if custom else ("quick" if a.quick else "full")
    a.duration = base[0] if a.duration is None else a.duration
    a.warmup = base[1] if a.warmup is None else a.warmup
    a.rounds = base[2] if a.rounds is None else a.rounds
    if a.duration <= 0 or a.warmup < 0 or min(a.concurrency, a.workers, a.procs, a.rounds) < 1:
        print("tgw-bench faces: --duration > 0, --warmup >= 0, --concurrency, --workers, --procs, --rounds >= 1",
              file=sys.stderr)
        return 2
    log = lambda msg: print(f"[faces {time.strftime('%H:%M:%S')}] {msg}", flush=True)  # noqa: E731
    work = tempfile.mkdtemp(prefix="tgwf-", dir="/tmp")   # short: ipc paths must fit 107 bytes
    t0, date = time.monotonic(), datetime.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    blocks: dict[str, dict[str, Any]] = {}
    servers: dict[str, Any] = {}
    flask = None
    rows: Optional[Rows] = None
    interrupted = False
    try:
        log(f"{mode} mode: {a.duration:g} s per row after {a.warmup:g} s warm-up; fronts {a.fronts}; work dir {work}")
        models = demo_models(os.path.join(work, "models"))
        rows = Rows(a, work, models, log)
        if not a.no_c1:   # up all along (idle, its workers sleep): its c=1 rows run beside each broker's
            flask, servers["flask"] = start_flask(a, models, work, log)
        for n in a.fronts:
            blocks[str(n)], servers[f"fronts={n}"] = run_broker(a, rows, models, work, n, flask, log)
    except KeyboardInterrupt:   # Ctrl-C, or SIGTERM (gpu-check.sh's timeout): what was measured is written
        print("\ninterrupted: stopping every server this run started", file=sys.stderr)
        interrupted = True
    finally:
        if flask is not None and not isinstance(flask, str):
            flask.stop()
        finish_run(work, a.keep)
    if not blocks:
        return 130
    for block in blocks.values():
        block.update(block_figures(block))
    result = {"mode": mode, "date": date, "command": a.command_line, "machine": report.machine(),
              "settings": {k: getattr(a, k) for k in ("duration", "warmup", "rounds", "fronts", "faces", "concurrency",
                                                      "workers", "flask_workers", "procs", "no_c1")},
              "notes": a.note, "model": MODEL, "http_generator": rows.http_generator if rows else "-",
              "clients": {"native": "tgw AsyncClient, one connection, every caller a coroutine on one loop",
                          "http": "HTTP binary (Triton's binary tensor extension) under the HTTP generator",
                          "grpc": "the generated KServe v2 stub over grpc.aio on one channel, bytes in and out "
                                  "(not tritonclient.grpc.aio, whose own Python cost would dominate the client's)",
                          "grpc-stream": "one ModelStreamInfer stream, every caller's request in flight on it",
                          "grpc-tritonclient": "tritonclient.grpc.aio's infer, one client (one channel)",
                          "native-c1": "one Python thread, the synchronous tgw Client",
                          "http-c1": "HTTP JSON (Flask's body) under the HTTP generator, one connection",
                          "flask-c1": "one Python thread, a keep-alive socket (loadgen's HTTP caller)",
                          "flask-c1-wrk": "HTTP JSON under the HTTP generator, one connection"},
              "fronts": blocks, "servers": servers, "interrupted": interrupted,
              "wall_s": time.monotonic() - t0}
    result["goals"] = goals(blocks)
    result["predicts"] = predicts_lines(blocks, os.cpu_count() or 1)
    print("\n" + table(blocks))
    for g in result["goals"]:
        v = "-" if g["value"] is None else f"{g['value']:.3g}"
        print(f"fronts={g['fronts']} {g['goal']}: {v} (goal {g['op']} {g['target']:g})"
              + ("" if g["met"] is None else " met" if g["met"] else " MISSED"))
    print("\n".join(result["predicts"]))
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    dest = a.out or ("bench" if os.path.isfile("bench/cli.py") else here)
    path = a.json or os.path.join(dest, "results", f"faces-{date}" + ("" if mode == "full" else f"-{mode}") + ".json")
    report.write_json(path, result)
    print(f"wrote {path}")
    every = [r for b in blocks.values() for r in b["rows"].values()]
    complete = bool(every) and all("error" not in r and not r["requests_failed"] for r in every)
    clean = all(s.get("exit_status", 0) == 0 and not s.get("shm_leftovers") for s in servers.values())
    return 130 if interrupted else 0 if complete and clean else 1


def start_flask(a, models: dict, work: str, log) -> tuple[Any, dict[str, Any]]:
    """Flask + gunicorn serving the same model, or why it did not start (its rows then say so)."""
    from tgw.bench.harness.baselines import FlaskServer
    log(f"Flask + gunicorn ({a.flask_workers} sync workers), for the c=1 rows beside each broker's")
    try:
        return FlaskServer({MODEL: models[MODEL]}, a.flask_workers, work), {"workers": a.flask_workers}
    except Exception as exc:  # noqa: BLE001 - the tgw rows still run
        err = f"{type(exc).__name__}: {exc}"
        log(f"Flask could not start: {err}")
        return err, {"error": err}


def run_broker(a, rows: Rows, models: dict, work: str, n: int, flask,
               log) -> tuple[dict[str, Any], dict[str, Any]]:
    """One broker with n fronts: each face at c=N, then the c=1 rows, each right after Flask's
    (a ratio pairs rows the shared box's load met alike); stopped by PID."""
    log(f"broker with server.front_processes={n}, {a.workers} cpu workers")
    try:
        b = Broker(a, work, models, n, log)
    except Exception as exc:  # noqa: BLE001 - the other front counts still run
        err = {"error": f"{type(exc).__name__}: {exc}"}
        log(f"the broker with {n} fronts could not start: {err['error']}")
        return {"rows": {f: err for f in a.faces}, "fronts_live": 0}, err
    block: dict[str, Any] = {"fronts_live": len(b.fronts), "front_pids": b.fronts, "note": b.note, "rows": {},
                             "rounds": []}
    try:
        for r in range(a.rounds):   # round r starts at face r: a drift of the box's load meets every face
            order = a.faces[r % len(a.faces):] + a.faces[:r % len(a.faces)]
            got = {face: rows.face(b, face, a.concurrency) for face in order}
            block["rounds"].append({face: figures(got[face]) for face in a.faces})
            for face in a.faces:
                block["rows"][face] = best(block["rows"].get(face), got[face])
        if not a.no_c1:
            for base, face in (("flask-c1", "native-c1"), ("flask-c1-wrk", "http-c1")):
                block["rows"][base] = {"error": flask} if isinstance(flask, str) else rows.flask(flask, base)
                block["rows"][face] = rows.face(b, face, 1)
    finally:
        server = b.stop()
    if server["exit_status"] != 0 or server["shm_leftovers"]:
        log(f"broker (fronts={n}) stop: exit status {server['exit_status']}, "
            f"/dev/shm leftovers {server['shm_leftovers']}")
    return block, server
