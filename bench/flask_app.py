"""The seed design's baseline: Flask + `torch.jit.load`, JSON bodies, under gunicorn sync workers.

    TGW_BENCH_FLASK_MODELS='{"mlp": {"path": "...", "inputs": ["x"]}}' \
        python -m gunicorn -w 2 -k sync -b 127.0.0.1:PORT 'tgw.bench.flask_app:create_app()'

POST /infer/<model> with {"inputs": {name: nested lists}} answers {"outputs": {name: nested
lists}}. Each worker process loads every model with `torch.jit.load` (as the seed design did: no
freezing) and uses one intra-op thread, since there are as many workers as cores.
"""
from __future__ import annotations

import json
import os

ENV = "TGW_BENCH_FLASK_MODELS"


def create_app():
    import torch
    from flask import Flask, jsonify, request

    torch.set_num_threads(int(os.environ.get("TGW_BENCH_FLASK_THREADS", "1")))
    decl = json.loads(os.environ[ENV])
    models = {name: (torch.jit.load(d["path"], map_location="cpu").eval(), d["inputs"], d.get("dtypes", {}))
              for name, d in decl.items()}
    app = Flask("tgw-bench-flask")

    @app.get("/health")
    def health():
        return jsonify({"ready": True, "models": sorted(models)})

    @app.post("/infer/<name>")
    def infer(name: str):
        if name not in models:
            return jsonify({"error": f"unknown model {name}"}), 404
        module, input_names, dtypes = models[name]
        body = request.get_json(force=True)
        try:
            args = [torch.tensor(body["inputs"][n], dtype=getattr(torch, dtypes.get(n, "float32")))
                    for n in input_names]
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
