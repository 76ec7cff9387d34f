"""`tgw-bench compare`: the baselines (baselines.py) and tgw (BrokerProc: native, and its KServe v2
HTTP face with JSON and binary bodies) on the same demo models, inputs and closed-loop scenarios,
in one invocation; bench/README.md says what each row and ratio means. Every server is stopped
by PID at the end, also on Ctrl-C, SIGTERM and errors.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, NamedTuple


from tgw.bench import plots, report
from tgw.bench.ratios import batching, scenario_result
from tgw.bench.baselines import EchoServer, floor_row, run_floors
from tgw.bench.flask_baseline import FlaskServer
from tgw.broker.child import BrokerProc, finish_run
from tgw.bench.loadgen import LoadSpec
from tgw.bench.measure import loadgen_drive, measure
from tgw.bench.wrk import WRK_INSTALL_HINT, wrk_drive
from tgw.bench.grpc_target import GrpcStreamTarget, GrpcTarget
from tgw.bench.targets import HttpTarget, TgwTarget, ZmqEchoTarget, tensor_bytes, v2_body, v2_target

SERVERS = ("transport", *report.TGW_SYSTEMS, "flask")
GRPC_TARGETS = {"tgw_grpc": GrpcTarget, "tgw_grpc_stream": GrpcStreamTarget}
MODES = {  # seconds measured per row, warm-up per row, seconds per floor batch size, floor rounds
    "quick": {"duration": 2.0, "warmup": 0.5, "floor_seconds": 0.5, "floor_rounds": 1},
    "full": {"duration": 15.0, "warmup": 3.0, "floor_seconds": 3.0, "floor_rounds": 2},
}


class Scenario(NamedTuple):
    model: str
    concurrency: int

    @property
    def key(self) -> str:
        return f"{self.model} c={self.concurrency}"


SCENARIOS = (Scenario("mlp", 1), Scenario("mlp", 16), Scenario("mlp", 64),
             Scenario("resnet", 1), Scenario("resnet", 16), Scenario("resnet", 64),
             Scenario("resnet224", 16))


def demo_models(out_dir: str) -> dict[str, dict[str, Any]]:
    """The product's demo models, built by `python -m tgw.workers.demo_models` in a subprocess (as
    the broker does) so torch stays out of the harness and of its generator processes. Returns
    name -> {path, inputs, outputs, max_batch_size} plus `resnet224`: the resnet file declared
    [3,224,224], so one request carries 602 KB."""
    proc = subprocess.run([sys.executable, "-m", "tgw.workers.demo_models", out_dir],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"building the demo models failed:\n{proc.stderr[-2000:]}")
    models = json.loads(proc.stdout.strip().splitlines()[-1])
    r = models["resnet"]
    models["resnet224"] = {**r, "inputs": [{**r["inputs"][0], "shape": [3, 224, 224]}], "max_batch_size": 16}
    return models


def tgw_config(models: dict[str, dict[str, Any]], names: list[str], workers: int) -> dict[str, Any]:
    """The broker of the tgw rows; its HTTP and gRPC faces (the tgw HTTP and gRPC rows) on any free
    ports of 127.0.0.1."""
    return {"server": {"max_request_bytes": 64 << 20}, "http": {"host": "127.0.0.1", "port": 0},
            "grpc": {"host": "127.0.0.1", "port": 0},
            "workers": {"devices": ["cpu"] * workers, "threads_per_worker": 1},  # arenas: auto
            "models": [{"name": n, "versions": [{"version": "1", "path": models[n]["path"]}],
                        "inputs": models[n]["inputs"], "outputs": models[n]["outputs"],
                        "max_batch_size": models[n]["max_batch_size"], "max_queue": 4096, "timeout_ms": 60000,
                        "warmup_batch_sizes": [1]} for n in names]}


class Servers:
    """The transport echo, the tgw broker (its native socket and its HTTP face) and gunicorn,
    started once; rows run against them and stop() stops them by PID. A server that fails to start
    marks its rows {"error": ...}; the other systems still run."""

    def __init__(self, a: argparse.Namespace, work: str, models: dict, names: list[str], log: Callable[[str], None]):
        self.a, self.work, self.models, self.names, self.log = a, work, models, names, log
        self.failed: dict[str, str] = {}
        self.info: dict[str, dict[str, Any]] = {"tgw": {}, "flask": {}}
        self.echo = self.tgw = self.flask = self.client = None
        self.wrk = shutil.which("wrk")
        self.http_generator = ""
        self.bodies: dict[tuple[str, bool], tuple[str, int]] = {}  # (model, binary) -> (file, JSON header bytes)

    def start(self, system: str) -> None:
        try:
            if system in report.HTTP_SYSTEMS:
                self._http_bodies()
            if system == "transport":
                self.echo = EchoServer(self.work)
            elif system in report.TGW_SYSTEMS:  # one broker for the three tgw rows
                self._broker()
                if system != "tgw" and "http" not in self.info["tgw"]:
                    status = self.client.status()   # its HTTP and gRPC faces
                    self.info["tgw"].update(http=status["http"], grpc=status["grpc"])
            else:
                self.flask = FlaskServer({n: self.models[n] for n in self.names}, self.a.flask_workers, self.work)
        except Exception as exc:  # noqa: BLE001 - the other systems still run
            self.failed[system] = f"{type(exc).__name__}: {exc}"
            self.log(f"{system} could not start: {self.failed[system]}")

    def _broker(self) -> None:
        if self.tgw is None:
            from tgw.client import Client
            self.tgw = BrokerProc(tgw_config(self.models, self.names, self.a.tgw_workers), self.work)
            self.client = Client(self.tgw.start(timeout=180).address)
            self.info["tgw"].update(config=self.tgw.config_path, processes=self.client.stats()["processes"])
        if self.client is None:
            raise RuntimeError("the tgw broker did not start (see the first tgw row)")

    def _http_bodies(self) -> None:
        """Once: the request bodies (v2 JSON, posted unchanged to Flask and to tgw's HTTP face; v2
        binary for tgw HTTP binary) and the HTTP generator (wrk, or the Python fallback)."""
        if self.bodies:
            return
        self.http_generator = f"wrk ({self.wrk})" if self.wrk else \
            "python fallback (wrk not installed: keep-alive HTTP/1.1 sockets through loadgen.py)"
        if not self.wrk:
            self.log(WRK_INSTALL_HINT)
        for n in self.names:
            for binary in (False, True):
                body, header = v2_body(self.models[n], binary)
                path = os.path.join(self.work, f"body-{n}.{'bin' if binary else 'json'}")
                with open(path, "wb") as f:
                    f.write(body)
                self.bodies[n, binary] = path, header

    def http_target(self, system: str, model: str) -> HttpTarget:
        """What the HTTP generator posts for `system`: the same path and JSON body to Flask and tgw."""
        url = f"http://127.0.0.1:{self.flask.port}" if system == "flask" else self.info["tgw"]["http"]
        return v2_target(url, model, *self.bodies[model, system == "tgw_http_bin"], system == "tgw_http_bin", system)

    def row(self, system: str, sc: Scenario) -> dict[str, Any]:
        """One measured row, or {"error": ...}: a failure is recorded and the run goes on."""
        if system in self.failed:
            return {"error": self.failed[system]}
        m, name = self.models[sc.model], f"{report.LABELS[system]} {sc.key}"
        spec = LoadSpec("closed", sc.concurrency, self.a.duration, self.a.warmup, self.a.procs)
        tgw = {"stats": self.client.stats} if system in report.TGW_SYSTEMS else {}
        processes = self.info["tgw"].get("processes")
        try:
            if system == "transport":
                target = ZmqEchoTarget(self.echo.front, tensor_bytes(m["inputs"]), tensor_bytes(m["outputs"]))
                row = measure(target, spec, self.echo.processes)
            elif system == "tgw":
                row = measure(TgwTarget(self.tgw.address, sc.model, timeout=60.0), spec, processes, **tgw)
            elif system in GRPC_TARGETS:
                target = GRPC_TARGETS[system](self.info["tgw"]["grpc"], sc.model, m, timeout=60.0)
                row = measure(target, spec, processes, **tgw)
            else:
                drive = functools.partial(wrk_drive, self.wrk) if self.wrk else \
                    functools.partial(loadgen_drive, kind="python-fallback")
                target = self.http_target(system, sc.model)
                row = {**measure(target, spec, self.flask.processes if system == "flask" else processes,
                                 drive=drive, **tgw), "body_bytes": os.path.getsize(target.body_path)}
        except Exception as exc:  # noqa: BLE001
            self.log(f"{name} FAILED: {type(exc).__name__}: {exc}")
            return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        p50, us = row["latency_ms"]["p50"], row.get("cpu_us_per_request") or {}
        self.log(f"{name}: {row['throughput_rps']:,.0f} req/s" + (f", p50 {p50:.3f} ms" if p50 is not None else "")
                 + "".join(f", {k} {us[k]:.1f} us/req" for k in ("broker", "workers", "generator")
                           if us.get(k) is not None)
                 + (f", PSS {row['server_pss_mb']:.0f} MiB" if row.get("server_pss_mb") is not None else "")
                 + (f", {row['requests_failed']} failed" if row["requests_failed"] else ""))
        return row

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
        for srv in (self.echo, self.flask):
            if srv is not None:
                srv.stop()
        if self.tgw is not None and self.tgw.proc is not None:
            from tgw.shm.segment import list_segments
            info = self.info["tgw"]
            info.update(exit_status=self.tgw.stop(timeout=20), shm_leftovers=list_segments(self.tgw.pid))
            if info["exit_status"] != 0 or info["shm_leftovers"]:
                self.log(f"tgw broker stop: exit status {info['exit_status']}, /dev/shm leftovers {info['shm_leftovers']}")


def collect(a: argparse.Namespace, work: str, models: dict, scenarios: list[Scenario],
            log: Callable[[str], None]) -> dict[str, Any]:
    """Floors first, then every scenario's server rows back to back across systems (so slow drifts
    of a shared machine's background load hit every system alike; idle servers sleep in
    poll/accept), then in full mode the floors again."""
    names = list(dict.fromkeys(sc.model for sc in scenarios))
    rows: dict[str, dict[str, Any]] = {sc.key: {} for sc in scenarios}
    res: dict[str, Any] = {}
    floor = functools.partial(run_floors, models, names, a.floor_seconds, a.floor_procs, log, module=a.floor_module)
    if "in-process" in a.systems:
        log("in-process floor (TorchScript called directly)")
        res["floors"] = floor()
    servers = [s for s in SERVERS if s in a.systems]
    if servers:
        log(f"starting {', '.join(servers)} (tgw: {a.tgw_workers} cpu workers; gunicorn: {a.flask_workers} sync workers)")
        srv = Servers(a, work, models, names, log)
        try:
            for system in servers:
                srv.start(system)
            for sc in scenarios:
                for system in servers:
                    rows[sc.key][system] = srv.row(system, sc)
        finally:
            srv.stop()
        res["tgw_server"], res["flask_server"], res["http_generator"] = srv.info["tgw"], srv.info["flask"], \
            srv.http_generator or "-"
    if "floors" in res and a.floor_rounds > 1:
        log("in-process floor again (the best of both rounds is kept)")
        res["floors"] = floor(previous=res["floors"])
    for sc in scenarios:
        if "floors" in res:
            rows[sc.key]["in-process"] = floor_row(res["floors"][sc.model])
        for system in report.TGW_SYSTEMS:
            if "error" not in rows[sc.key].get(system, {"error": ""}):
                rows[sc.key][system]["batching"] = batching(rows[sc.key][system],
                                                            (res.get("floors") or {}).get(sc.model), a.tgw_workers)
    return {"scenarios": [scenario_result(sc, tensor_bytes(models[sc.model]["inputs"]), rows[sc.key])
                          for sc in scenarios], **res}


def run(a: argparse.Namespace, command: str) -> int:
    """The whole comparison; exit status 0 when every row was filled without a failed request and
    the broker stopped cleanly, 1 otherwise, 130 when interrupted."""
    base = MODES["quick" if a.quick else "full"]
    custom = (a.duration, a.warmup, a.models) != (None, None, None) or a.floor_module != "freeze" \
        or set(a.systems) != set(report.SYSTEMS)
    mode = "custom" if custom else ("quick" if a.quick else "full")
    a.duration = base["duration"] if a.duration is None else a.duration
    a.warmup = base["warmup"] if a.warmup is None else a.warmup
    a.floor_seconds, a.floor_rounds = base["floor_seconds"], base["floor_rounds"]
    scenarios = [sc for sc in SCENARIOS if not a.models or sc.model in a.models]
    log = lambda msg: print(f"[compare {time.strftime('%H:%M:%S')}] {msg}", flush=True)  # noqa: E731
    work = tempfile.mkdtemp(prefix="tgwb-", dir="/tmp")  # short: ipc paths must fit 107 bytes
    t0, date = time.monotonic(), datetime.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    try:
        log(f"{mode} mode: {a.duration:g} s per row after {a.warmup:g} s warm-up; work dir {work}")
        res = collect(a, work, demo_models(os.path.join(work, "models")), scenarios, log)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every server this run started", file=sys.stderr)
        return 130
    finally:
        finish_run(work, a.keep)
    settings = {k: getattr(a, k) for k in ("duration", "warmup", "floor_seconds", "floor_module", "tgw_workers",
                                           "flask_workers", "floor_procs", "procs", "systems")}
    settings["http_generator"] = res.get("http_generator", "-")
    result = {"mode": mode, "date": date, "command": command, "machine": report.machine(), "settings": settings,
              **res, "wall_s": time.monotonic() - t0}
    print("\n" + report.text_table(report.compare_table(result["scenarios"]), 3))
    print("\n" + report.text_table(report.cost_table(result["scenarios"]), 2))
    # --out, else bench/ of the checkout (run from its root, or an editable install), else .
    here = os.path.dirname(os.path.abspath(__file__))
    dest = a.out or ("bench" if os.path.isfile("bench/compare.py") else
                     here if os.path.isfile(os.path.join(here, "RESULTS.md")) else ".")
    report.write_outputs(result, dest, results_md=not a.no_results_md, plot=plots.plot_compare)
    srv = result.get("tgw_server", {})
    complete = all("error" not in row and not row.get("requests_failed")
                   for sc in result["scenarios"] for row in sc["rows"].values())
    return 0 if complete and srv.get("exit_status", 0) == 0 and not srv.get("shm_leftovers") else 1
