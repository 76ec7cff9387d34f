"""The parts of `tgw-bench pipeline` (pipeline_bench.py) that are not tgw: the Flask + gunicorn
classify server, the load generator's targets for the classify rows, the in-process floor, and
the 5 ms spin model of the stage-concurrency row.

* Flask + gunicorn (`ClassifyFlask`): POST /classify with a raw JPEG body; per request the same
  decode + normalise as the demo's DecodeImage stage, the demo resnet as tgw's worker loads it
  (`load_in_process`), then softmax top-5 with the labels, answered as JSON. gunicorn sync
  workers (workers = cores), one torch thread each.
* `PipelineTarget`: one JPEG per request to the `classify` pipeline. `CallerDecodesTarget`: the
  caller decodes and normalises it (the same code), sends the float32 [3, 64, 64] tensor to
  `resnet` and takes the top 5 itself.
* `run_floor`: tgw.workers.demo_reference's classify (the same stages and model file) in one
  process per core, one torch thread each, batches of 1, 8 and 32 images; the best images/s.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import resource
import sys
import time
from dataclasses import dataclass

import numpy as np

from tgw.bench.flask_baseline import GunicornServer

CLASSIFY_ENV = "TGW_BENCH_CLASSIFY"   # {"resnet": file, "labels": file} for the Flask app


def images_of(folder: str) -> list[bytes]:
    names = sorted(n for n in os.listdir(os.path.join(folder, "images")) if n.endswith(".jpg"))
    return [open(os.path.join(folder, "images", n), "rb").read() for n in names]


# ---- Flask + gunicorn ------------------------------------------------------------------------------

def create_app():
    """gunicorn's app factory (`tgw.bench.pipeline_parts:create_app()`)."""
    import torch
    from flask import Flask, jsonify, request

    from tgw.workers.demo_vision import chosen_decoder, normalise
    from tgw.workers.formats import load_in_process
    torch.set_num_threads(1)
    files = json.loads(os.environ[CLASSIFY_ENV])
    model = load_in_process("torchscript", files["resnet"]).call
    labels = open(files["labels"], encoding="utf-8").read().splitlines()
    decode = chosen_decoder()
    app = Flask("tgw-bench-classify")

    @app.get("/health")
    def health():
        return jsonify({"ready": True})

    @app.post("/classify")
    def classify():
        try:
            pixels = normalise(decode(request.get_data()))
        except Exception as exc:  # noqa: BLE001 - a bad image is the caller's error
            return jsonify({"error": f"not a decodable JPEG: {exc}"}), 400
        with torch.inference_mode():
            scores, index = torch.softmax(model(torch.from_numpy(pixels[None])), dim=-1).topk(5, dim=-1)
        return jsonify({"labels": [labels[i] for i in index[0].tolist()], "scores": scores[0].tolist()})

    return app


class ClassifyFlask(GunicornServer):
    def __init__(self, resnet: str, labels: str, workers: int, workdir: str):
        super().__init__("tgw.bench.pipeline_parts:create_app()", workers, workdir, "gunicorn-classify.log",
                         {CLASSIFY_ENV: json.dumps({"resnet": resnet, "labels": labels})})


# ---- tgw targets -----------------------------------------------------------------------------------

@dataclass
class PipelineTarget:
    """One image per request to the pipeline `model` (label: the row's name)."""
    address: str
    folder: str
    model: str = "classify"
    stats_model: str = "resnet"   # whose batches the row's broker_stats show
    label: str = "tgw pipeline"
    image: int = 4                # which demo image every request sends (240x180, as the Flask rows)

    def open(self, seed: int):
        from tgw.client import Client
        self.client, self.images, self.seed = Client(self.address), images_of(self.folder), seed
        return self

    def caller(self, index: int):
        image = self.images[self.image]
        infer, model = self.client.infer, self.model
        self.client.health()   # this thread's socket and handshake

        def call() -> None:
            out = infer(model, {"image": [image]}, timeout=30)
            if len(out["labels"][0]) != 5:
                raise ValueError("an answer without 5 labels")
        return call

    def close(self) -> None:
        self.client.close()


@dataclass
class CallerDecodesTarget(PipelineTarget):
    """The caller decodes and normalises the JPEG, sends the tensor to `resnet`, takes the top 5."""
    model: str = "resnet"
    label: str = "tgw, caller decodes"

    def open(self, seed: int):
        from tgw.workers.demo_vision import chosen_decoder, normalise
        super().open(seed)
        self.decode, self.normalise = chosen_decoder(), normalise
        self.labels = open(os.path.join(self.folder, "labels.txt"), encoding="utf-8").read().splitlines()
        return self

    def caller(self, index: int):
        image = self.images[self.image]
        infer, decode, normalise, labels = self.client.infer, self.decode, self.normalise, self.labels
        self.client.health()

        def call() -> None:
            logits = infer("resnet", {"image": normalise(decode(image))[None]}, timeout=30)["logits"][0]
            best = np.argpartition(logits, -5)[-5:]
            best = best[np.argsort(logits[best])[::-1]]
            e = np.exp(logits - logits.max())
            _ = ([labels[i] for i in best], e[best] / e.sum())
        return call


# ---- the in-process floor ----------------------------------------------------------------------------

def _floor_copy(folder: str, batches: list[int], seconds: float, barrier, results) -> None:
    import torch
    torch.set_num_threads(1)
    from tgw.workers.demo_reference import DemoPipelines
    pipes, images = DemoPipelines(folder), images_of(folder)
    out = {}
    for b in batches:
        batch = [images[i % len(images)] for i in range(b)]
        for _ in range(3):
            pipes.classify(batch)
        barrier.wait()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            pipes.classify(batch)
            n += 1
        out[b] = n * b / (time.perf_counter() - t0)
    results.put(out)


def run_floor(folder: str, seconds: float, procs: int, batches: tuple[int, ...] = (1, 8, 32)) -> dict:
    """images/s of the in-process classify, per batch size summed over `procs` copies."""
    import psutil

    from tgw.bench.loadgen import cpu_seconds
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(procs, timeout=300), ctx.Queue()
    copies = [ctx.Process(target=_floor_copy, args=(folder, list(batches), seconds, barrier, results), daemon=True)
              for _ in range(procs)]
    machine0, child0, t0 = psutil.cpu_times(), cpu_seconds(resource.RUSAGE_CHILDREN), time.monotonic()
    for p in copies:
        p.start()
    try:
        got = [results.get(timeout=300) for _ in copies]
    finally:
        for p in copies:
            p.join(10)
            if p.is_alive():
                p.terminate()   # by PID: only the copies started here
    machine1, child1, wall = psutil.cpu_times(), cpu_seconds(resource.RUSAGE_CHILDREN), time.monotonic() - t0
    busy = (sum(machine1) - sum(machine0) - (machine1.idle - machine0.idle)) / wall   # cores, all processes
    per_batch = {b: sum(g[b] for g in got) for b in batches}
    best = max(per_batch, key=per_batch.get)
    return {"images_per_s_by_batch": {str(b): round(v, 1) for b, v in per_batch.items()}, "best_batch": best,
            "throughput_rps": per_batch[best], "procs": procs, "threads": 1,
            "other_cpu_cores": round(max(0.0, busy - (child1 - child0) / wall), 2)}


# ---- the 5 ms model of the stage-concurrency row -----------------------------------------------------

def build_spin(path: str, ms: float) -> dict:
    """A TorchScript model x float32 [4] -> y float32 [4] that computes for about `ms` per call (one
    torch thread: a loop of 128x128 matmuls, the count calibrated here); {path, iterations, ms}."""
    import torch
    torch.set_num_threads(1)

    class Spin(torch.nn.Module):
        def __init__(self, iterations: int) -> None:
            super().__init__()
            self.iterations = iterations

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            w = torch.full((128, 128), 1.0 / 128)
            m = torch.ones(128, 128)
            for _ in range(self.iterations):
                m = m @ w
            return x + m[0, 0] - 1.0

    def timed(n: int) -> float:
        module = torch.jit.freeze(torch.jit.script(Spin(n)).eval())
        x = torch.zeros(1, 4)
        for _ in range(3):
            module(x)
        t0 = time.perf_counter()
        for _ in range(10):
            module(x)
        return (time.perf_counter() - t0) / 10 * 1e3

    per_iteration = timed(200) / 200
    iterations = max(1, round(ms / per_iteration))
    torch.jit.save(torch.jit.script(Spin(iterations)), path)
    return {"path": path, "iterations": iterations, "ms": round(timed(iterations), 3)}


if __name__ == "__main__":   # python -m tgw.bench.pipeline_parts spin PATH MS: build it in a process of its own
    if len(sys.argv) != 4 or sys.argv[1] != "spin":
        sys.exit("usage: python -m tgw.bench.pipeline_parts spin PATH MS")
    print(json.dumps(build_spin(sys.argv[2], float(sys.argv[3]))))
