"""The comparison's machinery, shared by `tgw-bench compare` and `tgw-bench gpu`: its scenarios,
the servers (the baselines of baselines.py and tgw: BrokerProc, native, its KServe v2 HTTP face
with JSON and binary bodies, its gRPC face) started once, one measured row per (scenario,
system), the rows collected floors first, and each scenario's ratios and batching figures;
bench/README.md says what each row and ratio means. Every server is stopped by PID at the end,
also on Ctrl-C, SIGTERM and errors.
"""
from __future__ import annotations

import argparse
import functools
import os
import shutil
import traceback
from typing import Any, Callable, NamedTuple, Optional

import numpy as np

from tgw.bench.harness import report
from tgw.bench.harness.baselines import EchoServer, FlaskServer, floor_row, run_floors
from tgw.bench.harness.loadgen import LoadSpec
from tgw.bench.harness.measure import loadgen_drive, measure
from tgw.bench.harness.targets import (GrpcStreamTarget, GrpcTarget, HttpTarget, TgwTarget, ZmqEchoTarget,
                                       tensor_bytes, v2_body, v2_target)
from tgw.bench.harness.wrk import WRK_INSTALL_HINT, wrk_drive
from tgw.testing.child import BrokerProc
from tgw.testing.demo import tgw_config

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


# ---- the figures from the rows: each scenario's ratios, and how well the batches used the workers ----

GRPC_SYSTEMS = ("tgw_grpc", "tgw_grpc_stream")


def scenario_result(sc, payload_bytes: int, rows: dict[str, dict]) -> dict[str, Any]:
    """The scenario's rows with tgw native over Flask (throughput, p50), over the floor (rows/s) and
    over the transport floor (throughput); each HTTP row of tgw over Flask (throughput, p50) and over
    tgw native (throughput, broker CPU per request)."""
    def value(system: str, key: str) -> Optional[float]:
        row = rows.get(system) or {"error": None}
        if "error" in row:
            return None
        return row["latency_ms"]["p50"] if key == "p50" else \
            (row.get("cpu_us_per_request") or {}).get("broker") if key == "broker_us" else row[key]

    def ratio(a: str, b: str, key: str) -> Optional[float]:
        x, y = value(a, key), value(b, key)
        return x / y if x is not None and y else None
    # tgw's p50 over what a request cannot avoid: the transport's round trip and one batch-1 forward
    p50s = [value(s, "p50") for s in ("tgw", "transport", "in-process")]
    ratios = {"tgw_over_flask_throughput": ratio("tgw", "flask", "throughput_rps"),
              "tgw_over_flask_p50": ratio("tgw", "flask", "p50"),
              "tgw_over_floor_throughput": ratio("tgw", "in-process", "rows_per_s"),
              "tgw_over_transport_throughput": ratio("tgw", "transport", "throughput_rps"),
              "tgw_p50_excess_ms": None if None in p50s else p50s[0] - p50s[1] - p50s[2]}
    for s in report.TGW_SYSTEMS[1:]:
        ratios.update({f"{s}_over_flask_throughput": ratio(s, "flask", "throughput_rps"),
                       f"{s}_over_flask_p50": ratio(s, "flask", "p50"),
                       f"{s}_over_tgw_throughput": ratio(s, "tgw", "throughput_rps"),
                       f"{s}_broker_us_over_tgw": ratio(s, "tgw", "broker_us")})
    for s in GRPC_SYSTEMS:
        ratios[f"{s}_over_http_bin_throughput"] = ratio(s, "tgw_http_bin", "throughput_rps")
    return {"scenario": sc.key, "model": sc.model, "concurrency": sc.concurrency, "payload_bytes": payload_bytes,
            "rows": rows, "ratios": ratios}


def batching(tgw: dict[str, Any], floor: Optional[dict[str, Any]], workers: int) -> dict[str, Optional[float]]:
    """How well the broker's batches used the workers over the window: `worker_busy`, the share
    of the workers' time spent computing batches (their summed compute_us over window x workers),
    and `compute_over_floor`, their compute time over what the in-process floor takes for the
    same batches (each batch size formed, at the floor's mean latency for that size, interpolated
    between the sizes it measured)."""
    bs = tgw.get("broker_stats") or {}
    us, sizes = bs.get("compute_us"), bs.get("batch_sizes") or {}
    out: dict[str, Optional[float]] = {"worker_busy": None, "compute_us_per_row": None, "compute_over_floor": None}
    if not us or not bs.get("rows"):
        return out
    out["worker_busy"] = us / (tgw["duration_s"] * 1e6 * workers)
    out["compute_us_per_row"] = us / bs["rows"]
    if floor and "error" not in floor and sizes:
        b = [r["batch"] for r in floor["runs"]]
        ms = [r["latency_ms"]["mean"] for r in floor["runs"]]
        floor_us = sum(n * float(np.interp(int(k), b, ms)) * 1000 for k, n in sizes.items())
        out["compute_over_floor"] = us / floor_us if floor_us else None
    return out
