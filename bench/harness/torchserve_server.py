"""The real TorchServe (the `torchserve` CLI of the pip package, a Java frontend and one Python
process per model worker) as `tgw-bench torchserve`'s baseline: started in its own folder with a
config.properties the bench writes, waited for on /ping and on each model's workers, stopped by
PID.

TorchServe keeps its PID file in the temporary folder and writes logs/ into its working folder;
both point into the run's folder here (TMPDIR, TEMP, cwd), so a TorchServe started elsewhere on
the box (another session's tests) neither blocks this one nor is touched by it. Its workers run
this Python (`--python`, which the CLI passes as sys.executable) with OMP_NUM_THREADS as given,
the same torch threads per worker as tgw's.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
import urllib.request
from typing import Any, Optional

from tgw.testing.child import Proc

READY_TIMEOUT = 180.0   # the JVM's start, then each worker's Python, torch and handler import


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchserve_cli() -> Optional[str]:
    """The `torchserve` CLI beside this Python (a venv's bin/), else on $PATH; None when missing."""
    here = os.path.join(os.path.dirname(sys.executable), "torchserve")
    return here if os.access(here, os.X_OK) else shutil.which("torchserve")


def missing() -> Optional[str]:
    """Why TorchServe cannot run here (no java, no torchserve package), or None."""
    if not shutil.which("java") and not os.environ.get("JAVA_HOME"):
        return "java not found (TorchServe's frontend needs Java 11+; e.g. apt-get install openjdk-17-jre-headless)"
    if torchserve_cli() is None:
        return "torchserve not installed (pip install torchserve==0.12.0; tgw's `bench` extra has it)"
    return None


class TorchServe:
    """One TorchServe on 127.0.0.1 serving the archives of `store` named in `models`
    ({name: {"mar": file, ...}}), `workers` workers each."""

    def __init__(self, work: str, store: str, models: dict[str, dict[str, Any]], workers: int,
                 torch_threads: int = 1):
        self.dir, self.store, self.models, self.workers = work, store, models, workers
        self.torch_threads = torch_threads
        os.makedirs(work, exist_ok=True)
        self.inference_port, self.management_port, self.metrics_port = free_port(), free_port(), free_port()
        # its gRPC APIs too: their defaults (7070, 7071) taken by another TorchServe stop this one
        self.grpc_ports = free_port(), free_port()
        self.config_path = os.path.join(work, "config.properties")
        self.proc: Optional[Proc] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.inference_port}"

    @property
    def management(self) -> str:
        return f"http://127.0.0.1:{self.management_port}"

    def describe(self, name: str) -> Any:
        """The management API's `GET /models/{name}`."""
        return self._get(f"{self.management}/models/{name}")

    def properties(self) -> str:
        """config.properties: every address on 127.0.0.1, the default workers per model (each
        archive's model-config.yaml carries its batching, read by TorchServe and tgw alike)."""
        lines = {"inference_address": self.url,
                 "management_address": self.management,
                 "metrics_address": f"http://127.0.0.1:{self.metrics_port}",
                 "grpc_inference_address": "127.0.0.1", "grpc_management_address": "127.0.0.1",
                 "grpc_inference_port": str(self.grpc_ports[0]), "grpc_management_port": str(self.grpc_ports[1]),
                 "model_store": self.store,
                 "default_workers_per_model": str(self.workers),
                 "job_queue_size": "1000",      # the default 100 would refuse a deep closed loop's bursts
                 "install_py_dep_per_model": "false",
                 "disable_token_authorization": "true",
                 "enable_metrics_api": "false"}
        return "".join(f"{k}={v}\n" for k, v in lines.items())

    def start(self, timeout: float = READY_TIMEOUT) -> "TorchServe":
        why = missing()
        if why:
            raise RuntimeError(why)
        with open(self.config_path, "w") as f:
            f.write(self.properties())
        tmp = os.path.join(self.dir, "tmp")
        os.makedirs(tmp, exist_ok=True)
        argv = [torchserve_cli(), "--start", "--foreground", "--ncs", "--disable-token-auth",
                "--model-store", self.store, "--ts-config", self.config_path,
                "--models", *(f"{n}={m['mar']}" for n, m in self.models.items())]
        self.proc = Proc(argv, os.path.join(self.dir, "torchserve.log"), "torchserve")
        cwd = os.getcwd()
        os.chdir(self.dir)   # its logs/ land in the run's folder
        try:
            self.proc.start(env={"TMPDIR": tmp, "TEMP": tmp, "OMP_NUM_THREADS": str(self.torch_threads),
                                 "MKL_NUM_THREADS": str(self.torch_threads)})
        finally:
            os.chdir(cwd)
        self.proc.wait_for(self.ready, timeout, f"/ping and {self.workers} ready worker(s) per model")
        return self

    def _get(self, url: str) -> Any:
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read())

    def ready(self) -> bool:
        """/ping healthy and every model's workers READY (the management API's describe)."""
        if self._get(f"{self.url}/ping").get("status") != "Healthy":
            return False
        for name in self.models:
            desc = self.describe(name)
            ready = [w for w in desc[0].get("workers", []) if w.get("status") == "READY"]
            if len(ready) < self.workers:
                return False
        return True

    def processes(self) -> list[dict[str, Any]]:
        """The frontend (the JVM) and its model workers, as measure()'s ProcessMonitor takes them.
        The JVM's periodic system-metrics collector (a short-lived Python child) is left out: a
        process gone before the window's end has no CPU to read, and leaving it out is in
        TorchServe's favour."""
        import psutil
        out = []
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                java = "java" in os.path.basename(p.exe() or p.name())
                worker = any("model_service_worker" in part for part in p.cmdline())
            except psutil.Error:
                continue
            if java or worker:
                out.append({"role": "frontend" if java else "worker", "pid": p.pid})
        return out

    def stop(self, timeout: float = 60.0) -> dict[str, Any]:
        """SIGTERM to the JVM by PID (its shutdown hook stops the workers), then the CLI's wait
        ends; anything of its tree still alive after `timeout` gets SIGKILL, by PID. Returns
        {exit_status, left}: the launcher's exit status and the PIDs that had to be killed."""
        import psutil
        if self.proc is None or not self.proc.alive():
            return {"exit_status": None if self.proc is None else self.proc.proc.returncode, "left": []}
        tree = psutil.Process(self.proc.pid).children(recursive=True)
        for p in tree:
            if p.ppid() == self.proc.pid:   # the JVM, the launcher's one child
                p.send_signal(signal.SIGTERM)
        gone, alive = psutil.wait_procs(tree, timeout=timeout)
        for p in alive:
            p.kill()
        try:   # the CLI returns once its JVM has gone
            self.proc.proc.wait(timeout=10)
        except Exception:  # noqa: BLE001 - Proc.stop below signals it
            pass
        status = self.proc.stop(timeout=10)
        return {"exit_status": status, "left": [p.pid for p in alive]}

