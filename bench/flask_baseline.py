"""Start the Flask + gunicorn baseline and load it with wrk (or the Python fallback generator).

gunicorn runs `tgw.bench.flask_app:create_app()` with as many sync workers as cores, bound to
127.0.0.1 on a free port; it is stopped by its master's PID (SIGTERM: graceful shutdown of its
workers). Rows come back in the same shape as `summary.summarize()` so tables treat all alike.
"""
from __future__ import annotations

import json
import os
import resource
import socket
import sys
import urllib.request
from typing import Any, Optional

import psutil

from tgw.bench import wrk as wrklib
from tgw.bench.loadgen import LoadSpec, run_load
from tgw.bench.monitor import ProcessMonitor
from tgw.bench.procs import Managed, wait_until
from tgw.bench.summary import background_cpu, summarize, warnings_for
from tgw.bench.targets import HttpTarget


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FlaskServer:
    def __init__(self, models: dict[str, dict], workers: int, log_path: Optional[str] = None,
                 start_timeout: float = 120):
        """models: name -> {"path": file, "inputs": [input names], "dtypes": {input: dtype}}."""
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "TGW_BENCH_FLASK_MODELS": json.dumps(models), "PYTHONUNBUFFERED": "1"}
        argv = [sys.executable, "-m", "gunicorn", "-w", str(workers), "-k", "sync",
                "-b", f"127.0.0.1:{self.port}", "--timeout", "300", "--graceful-timeout", "5",
                "--log-level", "warning", "tgw.bench.flask_app:create_app()"]
        self.master = Managed(argv, "gunicorn", log_path, env=env)
        try:
            wait_until(lambda: self._workers_ready(workers), start_timeout, "gunicorn workers", self.master, 0.3)
        except BaseException:
            self.stop()
            raise

    def _workers_ready(self, n: int) -> bool:
        # each worker loads torch and the models on start; wait until n answered /health
        if len(psutil.Process(self.master.pid).children()) < n:
            return False
        seen = set()
        for _ in range(4 * n):
            with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                seen.add(r.headers.get("X-Pid") or len(seen))
                if r.status != 200:
                    return False
        return True

    @property
    def processes(self) -> list[dict[str, Any]]:
        procs = [{"role": "gunicorn-master", "pid": self.master.pid, "device": "cpu"}]
        try:
            procs += [{"role": "gunicorn-worker", "pid": c.pid, "device": "cpu"}
                      for c in psutil.Process(self.master.pid).children()]
        except psutil.Error:
            pass
        return procs

    def stop(self) -> None:
        self.master.stop(grace=15)


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_http(server: FlaskServer, model: str, body_path: str, concurrency: int, duration: float,
             warmup: float, wrk: Optional[str], lua_path: str) -> dict[str, Any]:
    """One closed-loop scenario against the Flask server; returns a summary-shaped row."""
    url = f"{server.base}/infer/{model}"
    mon = ProcessMonitor(server.processes).start()
    try:
        if wrk:
            wrklib.write_lua(body_path, lua_path)
            if warmup > 0:
                wrklib.run_wrk(wrk, url, lua_path, concurrency, warmup)
            cpu0 = _children_cpu()
            mon.window_start()
            res = wrklib.run_wrk(wrk, url, lua_path, concurrency, duration)
            mon.window_end()
            gen_cpu = _children_cpu() - cpu0
            dur = res["duration_s"]
            n_err = sum(res["errors"].values())
            # wrk counts completed responses; non-2xx ones are in errors.status, socket errors and
            # timeouts are failed attempts outside `requests`
            ok = max(0, res["requests"] - res["errors"].get("status", 0))
            row = {"mode": "closed", "level": concurrency, "duration_s": dur, "warmup_s": warmup, "batch": 1,
                   "requests_ok": ok, "requests_failed": n_err, "throughput_rps": ok / dur, "rows_per_s": ok / dur,
                   "latency_ms": res["latency_ms"] if res["requests"] else {k: None for k in res["latency_ms"]},
                   "errors": {f"wrk_{k}": v for k, v in res["errors"].items()},
                   "generator": {"kind": "wrk", "argv": res["argv"], "cpu_cores": gen_cpu / dur,
                                 "cpu_share_of_machine": gen_cpu / dur / (os.cpu_count() or 1),
                                 "saturated": gen_cpu / dur >= 0.9 * min(concurrency, 2)}}
        else:
            with open(body_path, "rb") as f:
                body = f.read()
            target = HttpTarget("127.0.0.1", server.port, f"/infer/{model}", body, label="flask")
            raw = run_load(target, LoadSpec("closed", concurrency, duration, warmup),
                           on_window_start=mon.window_start, on_window_end=mon.window_end)
            row = summarize(raw)
            row["generator"]["kind"] = "python-fallback"
    finally:
        mon.stop()
    row["server_processes"] = mon.report(row["duration_s"])
    busy = mon.machine_cpu_busy()
    own = row["generator"]["cpu_cores"] + sum(p["cpu_cores"] or 0 for p in row["server_processes"]) + mon.self_cores()
    row["machine"] = {"cpu_busy": busy, "cores": os.cpu_count(), "other_cpu_cores": background_cpu(busy, own)}
    row["warnings"] = warnings_for(row)
    return row
