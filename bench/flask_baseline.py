"""The seed design tgw is compared with (`FlaskServer`): Flask + `torch.jit.load` (not frozen, as
the seed did), the KServe v2 JSON bodies tgw's HTTP face takes, gunicorn sync workers with one
torch thread each, on 127.0.0.1; a model declared with a "device" (bench/gpu_bench.py) runs
there. `GunicornServer` runs any Flask app factory so (pipeline_parts.py's too)."""
from __future__ import annotations

import json
import os
import socket
import sys
import urllib.request
from typing import Any

from tgw.broker.child import Proc
from tgw.bench.baselines import Server
from tgw.bench.targets import v2_datatype

FLASK_MODELS_ENV = "TGW_BENCH_FLASK_MODELS"


def create_app():
    """gunicorn's app factory (`tgw.bench.flask_baseline:create_app()`); the models come in the environment.
    It takes the body tgw's HTTP face takes, a KServe v2 JSON request (`{"inputs": [{name, shape,
    datatype, data (flat)}]}`), as a typical Flask server would: Flask's JSON, then
    `torch.tensor(data, dtype).reshape(shape)` per input, and answers in the v2 shape (`outputs`
    with flat `data` lists)."""
    import torch
    from flask import Flask, jsonify, request

    torch.set_num_threads(1)
    models = {name: (torch.jit.load(d["path"], map_location=d.get("device", "cpu")).eval(), d["inputs"], d["outputs"],
                     d.get("device", "cpu"))
              for name, d in json.loads(os.environ[FLASK_MODELS_ENV]).items()}
    app = Flask("tgw-bench-flask")

    @app.get("/health")
    def health():
        return jsonify({"ready": True, "models": sorted(models)})

    @app.post("/v2/models/<name>/infer")
    def infer(name: str):
        module, inputs, outputs, device = models[name]
        body = {i["name"]: i for i in request.get_json(force=True)["inputs"]}
        with torch.inference_mode():
            out = module(*[torch.tensor(body[d["name"]]["data"], dtype=getattr(torch, d["dtype"]), device=device)
                           .reshape(body[d["name"]]["shape"]) for d in inputs])
        # the demo models return one tensor or a dict of them; .tolist() below brings a GPU's back
        out = out if isinstance(out, dict) else {outputs[0]["name"]: out}
        return jsonify({"model_name": name, "outputs": [
            {"name": k, "datatype": v2_datatype(v.dtype), "shape": list(v.shape), "data": v.flatten().tolist()}
            for k, v in out.items()]})

    return app


class GunicornServer(Server):
    """A Flask app (`app`: gunicorn's "module:create_app()") under gunicorn with `workers` sync
    workers on a free 127.0.0.1 port, ready once every worker answers /health; `env` configures it."""

    def __init__(self, app: str, workers: int, workdir: str, log_name: str, env: dict[str, str], device: str = "cpu"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.master = Proc([sys.executable, "-m", "gunicorn", "-w", str(workers), "-k", "sync",
                            "-b", f"127.0.0.1:{self.port}", "--timeout", "300", "--graceful-timeout", "5",
                            "--log-level", "warning", app], os.path.join(workdir, log_name), "gunicorn")
        self.device = device
        super().__init__([self.master], lambda: self._workers_ready(workers), 120,
                         env={**env, "PYTHONUNBUFFERED": "1"})

    def _workers_ready(self, n: int) -> bool:
        # each worker loads torch and the models when it starts: n workers, several answers
        if len(self.processes) < n + 1:
            return False
        for _ in range(4 * n):
            urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5).close()  # raises unless 2xx
        return True

    @property
    def processes(self) -> list[dict[str, Any]]:
        import psutil
        procs = [{"role": "gunicorn-master", "pid": self.master.pid, "device": "cpu"}]
        try:
            procs += [{"role": "gunicorn-worker", "pid": c.pid, "device": self.device}
                      for c in psutil.Process(self.master.pid).children()]
        except psutil.Error:
            pass
        return procs


class FlaskServer(GunicornServer):
    def __init__(self, models: dict[str, dict[str, Any]], workers: int, workdir: str):
        """models: name -> {"path": file, "inputs"/"outputs": [{"name", "dtype", ...}], ...} (the demo
        declarations), optionally "device" (default cpu): where each gunicorn worker runs it."""
        decl = {n: {k: m[k] for k in ("path", "inputs", "outputs", "device") if k in m} for n, m in models.items()}
        super().__init__("tgw.bench.flask_baseline:create_app()", workers, workdir, "gunicorn.log",
                         {FLASK_MODELS_ENV: json.dumps(decl)},
                         ",".join(sorted({m.get("device", "cpu") for m in models.values()})))
