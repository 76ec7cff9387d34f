"""A pipelines config for the tests: three steps over four declared models (one no pipeline
uses), each model's files named after it (stubs: never loaded)."""
from __future__ import annotations


def model(name: str, inputs: list, outputs: list, **extra) -> dict:
    return {"name": name, "versions": [{"version": "1", "path": f"{name}.pt"}],
            "inputs": [{"name": n, "dtype": d, "shape": s} for n, d, s in inputs],
            "outputs": [{"name": n, "dtype": d, "shape": s} for n, d, s in outputs], **extra}


def valid() -> dict:
    return {"models": [
        model("dec", [("image", "uint8", [-1, 3])], [("pixels", "float32", [3, 8])], max_batch_size=16),
        model("net", [("x", "float32", [3, 8])], [("logits", "float32", [10]), ("emb", "float32", [4])],
              max_batch_size=8),
        model("top", [("logits", "float32", [-1])], [("labels", "int64", [5]), ("scores", "float32", [5])]),
        model("join", [("a", "float32", [10]), ("b", "float32", [4])], [("y", "float32", [10])]),
    ], "pipelines": [{
        "name": "classify", "version": "3", "timeout_ms": 500, "inputs": ["image"],
        "steps": [{"name": "decode", "model": "dec", "inputs": {"image": "image"}},
                  {"name": "infer", "model": "net", "version": "1", "inputs": {"x": "decode.pixels"}},
                  {"name": "top5", "model": "top", "inputs": {"logits": "infer.logits"}}],
        "outputs": {"labels": "top5.labels", "scores": "top5.scores"}}]}
