"""The seed design's baseline: Flask + `torch.jit.load` (no freezing, as the seed did), JSON
bodies, gunicorn sync workers with one torch thread each, on 127.0.0.1; stopped by the master's
PID (SIGTERM: gunicorn's graceful shutdown). POST /infer/<model> {"inputs": {name: lists}}
answers {"outputs": {name: lists}}.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import urllib.request
from typing import Any

from tgw.bench.broker_proc import Proc

ENV = "TGW_BENCH_FLASK_MODELS"


def create_app():
    import torch
    from flask import Flask, jsonify, request

    torch.set_num_threads(int(os.environ.get("TGW_BENCH_FLASK_THREADS", "1")))
    models = {name: (torch.jit.load(d["path"], map_location="cpu").eval(), d["inputs"])
              for name, d in json.loads(os.environ[ENV]).items()}
    app = Flask("tgw-bench-flask")

    @app.get("/health")
    def health():
        return jsonify({"ready": True, "models": sorted(models)})

    @app.post("/infer/<name>")
    def infer(name: str):
        if name not in models:
            return jsonify({"error": f"unknown model {name}"}), 404
        module, inputs = models[name]
        body = request.get_json(force=True)
        try:
            args = [torch.tensor(body["inputs"][i["name"]], dtype=getattr(torch, i["dtype"])) for i in inputs]
        except (KeyError, TypeError, ValueError) as exc:
            return jsonify({"error": f"bad input: {exc}"}), 400
        with torch.inference_mode():
            out = module(*args)
        if isinstance(out, dict):
            outputs = {k: v.tolist() for k, v in out.items()}
        elif isinstance(out, (tuple, list)):
            outputs = {f"output_{i}": v.tolist() for i, v in enumerate(out)}
        else:
            outputs = {"output_0": out.tolist()}
        return jsonify({"outputs": outputs})

    return app


class FlaskServer(Proc):
    def __init__(self, models: dict[str, dict[str, Any]], workers: int, workdir: str, start_timeout: float = 120):
        """models: name -> {"path": file, "inputs": [{"name", "dtype", ...}], ...} (the demo declarations)."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        super().__init__([sys.executable, "-m", "gunicorn", "-w", str(workers), "-k", "sync",
                          "-b", f"127.0.0.1:{self.port}", "--timeout", "300", "--graceful-timeout", "5",
                          "--log-level", "warning", "tgw.bench.flask_app:create_app()"],
                         os.path.join(workdir, "gunicorn.log"), "gunicorn")
        decl = {n: {"path": m["path"], "inputs": m["inputs"]} for n, m in models.items()}
        self.start(env={ENV: json.dumps(decl), "PYTHONUNBUFFERED": "1"})
        try:
            self.wait_for(lambda: self._workers_ready(workers), start_timeout, f"{workers} gunicorn workers", 0.3)
        except BaseException:
            self.stop()
            raise

    def _workers_ready(self, n: int) -> bool:
        # each worker loads torch and the models when it starts: n workers, several answers
        if len(self.processes) < n + 1:
            return False
        for _ in range(4 * n):
            urllib.request.urlopen(self.base + "/health", timeout=5).close()  # raises unless 2xx
        return True

    @property
    def processes(self) -> list[dict[str, Any]]:
        import psutil
        procs = [{"role": "gunicorn-master", "pid": self.pid, "device": "cpu"}]
        try:
            procs += [{"role": "gunicorn-worker", "pid": c.pid, "device": "cpu"}
                      for c in psutil.Process(self.pid).children()]
        except psutil.Error:
            pass
        return procs
