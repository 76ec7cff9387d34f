"""The servers the generation benchmark compares tgw generate with (`tgw-bench generate`).

* Flask + gunicorn (`FlaskStreamServer`): POST /generate {"prompt": [ids], "max_outputs": n}
  answers a chunked text/plain stream, one line per output, from the model's own KV-cache loop
  (gen_model.prefill/step), one sequence at a time per gunicorn sync worker, one torch thread each.
* LitServe (`LitServeServer`, when `litserve` is installed - the `bench-litserve` extra): the
  process of gen_litserve.py, `LitAPI(stream=True)` on the same loop.
* The tgw one-shot stage (`NextToken`): the next output from the whole sequence so far, no cache
  kept between calls - tgw's only way before generators, one `Client.infer` per output. Its
  inputs are `tokens` int64 [max_len] (zero-padded) and `length` int64 []; a batch runs on its
  longest row's tokens (causal attention: the padding never reaches a row's last position).

The model's weights file (gen_model.save_weights) comes in the environment (GEN_MODEL_ENV) or in
the stage's options (`weights`).
"""
from __future__ import annotations

import json
import os
import socket
import sys
import urllib.request
from typing import Any

from tgw.bench.harness import gen_model
from tgw.bench.harness.baselines import GunicornServer, Server
from tgw.testing.child import Proc

GEN_MODEL_ENV = "TGW_BENCH_GEN_MODEL"


def model_from_env():
    import torch
    torch.set_num_threads(1)
    return gen_model.load(os.environ[GEN_MODEL_ENV])


def _one_sequence(module, kv, prompt: list[int], n: int):
    """The outputs of one sequence, one at a time (the model's own KV-cache loop, batch of 1)."""
    import torch
    with torch.inference_mode():
        last = gen_model.prefill(module, [prompt], kv)[0]
        yield last
        pos = torch.tensor([len(prompt)])
        tok = torch.tensor([last])
        for _ in range(n - 1):
            tok = gen_model.step(module, tok, kv, pos)
            pos += 1
            yield int(tok[0])


def bad_request(body: Any, max_len: int) -> str:
    if not isinstance(body, dict) or not isinstance(body.get("prompt"), list) or not body["prompt"]:
        return "body must be {\"prompt\": [token ids], \"max_outputs\": n}"
    n = body.get("max_outputs", gen_model.OUTPUTS)
    if not isinstance(n, int) or n < 1 or len(body["prompt"]) + n > max_len:
        return f"prompt + max_outputs must fit max_len {max_len}"
    return ""


# ---- Flask + gunicorn ------------------------------------------------------------------------------

def create_stream_app():
    """gunicorn's app factory (`tgw.bench.harness.gen_baselines:create_stream_app()`)."""
    from flask import Flask, Response, jsonify, request, stream_with_context

    module = model_from_env()
    kv = gen_model.kv_pool(module, 1)
    app = Flask("tgw-bench-gen-flask")

    @app.get("/health")
    def health():
        return jsonify({"ready": True})

    @app.post("/generate")
    def generate():
        body = request.get_json(force=True, silent=True)
        problem = bad_request(body, module.cfg.max_len)
        if problem:
            return jsonify({"error": problem}), 400
        lines = (f"{t}\n" for t in _one_sequence(module, kv, body["prompt"], body.get("max_outputs", gen_model.OUTPUTS)))
        return Response(stream_with_context(lines), mimetype="text/plain")

    return app


class FlaskStreamServer(GunicornServer):
    def __init__(self, weights: str, workers: int, workdir: str):
        super().__init__("tgw.bench.harness.gen_baselines:create_stream_app()", workers, workdir,
                         "gunicorn-gen.log", {GEN_MODEL_ENV: weights})


# ---- LitServe --------------------------------------------------------------------------------------

def litserve_missing() -> str:
    """Why LitServe cannot run here ("" when it can)."""
    try:
        import litserve  # noqa: F401
    except ImportError as exc:
        return f"litserve is not installed ({exc}); `pip install -e .[bench-litserve]` installs it beside torch"
    return ""


class LitServeServer(Server):
    def __init__(self, weights: str, workers: int, max_batch: int, workdir: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        py = [sys.executable, "-m", "tgw.bench.harness.gen_litserve"]
        self.proc = Proc([*py, str(self.port), str(workers), str(max_batch)], os.path.join(workdir, "litserve.log"),
                         "litserve")
        super().__init__([self.proc], self._ready, 180,
                         env={GEN_MODEL_ENV: weights, "PYTHONUNBUFFERED": "1"})

    def _ready(self) -> bool:
        urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5).close()
        return True

    def stop(self) -> None:
        """The server, then its process tree (LitServe's workers and API servers outlive their
        parent's SIGTERM), each by PID."""
        import psutil
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            kids = []
        super().stop()
        for k in kids:
            try:
                k.terminate()
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(kids, timeout=10)
        for k in alive:
            try:
                k.kill()
            except psutil.Error:
                pass

    @property
    def processes(self) -> list[dict[str, Any]]:
        import psutil
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            kids = []
        return [{"role": "litserve", "pid": self.proc.pid}] + [{"role": "litserve-child", "pid": c.pid} for c in kids]


# ---- the tgw one-shot stage ------------------------------------------------------------------------

class NextToken:
    """A tgw stage: the next output of each row's whole sequence, computed from scratch."""

    def setup(self, context) -> None:
        self.module = gen_model.load(context.options["weights"])

    def __call__(self, batch) -> dict[str, Any]:
        import torch
        lengths = batch["length"].long()
        if bool((lengths < 1).any()) or bool((lengths > batch["tokens"].shape[1]).any()):
            raise ValueError(f"length must be 1..{batch['tokens'].shape[1]}, got {lengths.tolist()}")
        longest = int(lengths.max())
        kv = gen_model.kv_pool(self.module, batch.rows)
        with torch.inference_mode():
            logits = self.module.forward_tokens(batch["tokens"][:, :longest].long(), kv, torch.zeros_like(lengths))
            picked = logits[torch.arange(batch.rows), lengths - 1].argmax(-1)
        return {"token": picked}
