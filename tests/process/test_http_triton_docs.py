"""Triton's model config and statistics over HTTP, read by the real tritonclient.http.

One broker for the module: mlp with a numeric and a non-numeric version, "fails" (raises on a
negative first element) and a pipeline of two "fails" steps."""
from __future__ import annotations

import json
import tempfile
import urllib.request

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import base_config, readme_block, served


@pytest.fixture(scope="module")
def broker(model_files):
    d = tempfile.mkdtemp(prefix="tgwtd-", dir="/tmp")
    mlp_path = model_files["mlp"][0]
    cfg = base_config(model_files, "mlp", "fails",
                      mlp={"versions": [{"version": "1", "path": mlp_path}, {"version": "beta", "path": mlp_path}],
                           "default_version": "1", "preferred_batch_sizes": [4], "max_delay_us": 100},
                      fails={"max_batch_size": 4})
    cfg["pipelines"] = [{"name": "twice", "inputs": ["x"],
                         "steps": [{"name": "first", "model": "fails", "inputs": {"x": "x"}},
                                   {"name": "second", "model": "fails", "version": "1", "inputs": {"x": "first.y"}}],
                         "outputs": {"y": "second.y"}}]
    cfg["http"] = {"port": 0}
    yield from served(cfg, d, http=True)


@pytest.fixture(scope="module")
def triton(broker):
    c = httpclient.InferenceServerClient(broker.http.removeprefix("http://"))
    yield c
    c.close()


def infer(triton, model: str, x: np.ndarray, version: str = ""):
    inp = httpclient.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return triton.infer(model, [inp], model_version=version)


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def test_model_config(triton):
    cfg = triton.get_model_config("mlp")
    assert cfg["name"] == "mlp" and cfg["platform"] == "pytorch_libtorch" and cfg["backend"] == "pytorch"
    assert cfg["input"][0]["name"] == "x" and cfg["input"][0]["data_type"] == "TYPE_FP32"
    assert cfg["input"][0]["dims"] == [256] and cfg["output"][0]["dims"] == [10]
    assert cfg["max_batch_size"] == 64
    assert cfg["dynamic_batching"] == {"preferred_batch_size": [4], "max_queue_delay_microseconds": 100,
                                       "preserve_ordering": False}
    assert cfg["version_policy"] == {"specific": {"versions": [1, 2]}}   # "beta" is 2
    assert cfg["instance_group"] == [{"name": "mlp_cpu", "kind": "KIND_CPU", "count": 1, "gpus": []}]
    assert triton.get_model_config("mlp", "2")["name"] == "mlp"          # by its alias
    assert triton.get_model_config("mlp", "beta")["name"] == "mlp"       # and by its name
    assert "dynamic_batching" in triton.get_model_config("fails")
    with pytest.raises(InferenceServerException, match="Request for unknown model: 'mlp' version 7 is not found"):
        triton.get_model_config("mlp", "7")


def test_declaration_and_pipeline_config(broker, triton):
    decl = get(f"{broker.http}/v2/models/mlp/declaration")
    assert [v["version"] for v in decl["versions"]] == ["1", "beta"] and decl["max_delay_us"] == 100
    assert get(f"{broker.http}/v2/models/twice/declaration")["steps"][0]["name"] == "first"
    cfg = triton.get_model_config("twice")
    assert cfg["platform"] == "ensemble" and cfg["input"][0]["name"] == "x" and cfg["output"][0]["name"] == "y"
    assert cfg["ensemble_scheduling"]["step"] == [
        {"model_name": "fails", "model_version": -1, "input_map": {"x": "x"}, "output_map": {"y": "first.y"}},
        {"model_name": "fails", "model_version": 1, "input_map": {"x": "first.y"}, "output_map": {"y": "y"}}]


def test_statistics(broker, triton):
    assert "statistics" in triton.get_server_metadata()["extensions"]
    for rows in (1, 3, 1):
        infer(triton, "mlp", np.random.rand(rows, 256).astype(np.float32), version="1")
    infer(triton, "mlp", np.random.rand(2, 256).astype(np.float32), version="2")   # beta, by its alias
    infer(triton, "fails", np.ones((1, 2), np.float32))
    with pytest.raises(InferenceServerException, match="negative input"):
        infer(triton, "fails", -np.ones((1, 2), np.float32))
    stats = triton.get_inference_statistics(model_name="mlp")["model_stats"]
    assert [(s["name"], s["version"]) for s in stats] == [("mlp", "1"), ("mlp", "2")]
    one, beta = stats
    inf = one["inference_stats"]
    assert inf["success"]["count"] == 3 and inf["fail"]["count"] == 0 and inf["success"]["ns"] > 0
    assert inf["queue"]["count"] == 3 and inf["compute_infer"]["count"] == 3 and inf["compute_infer"]["ns"] > 0
    assert one["inference_count"] == 5 and one["execution_count"] == 3 and one["last_inference"] > 1.6e12
    assert {b["batch_size"]: b["compute_infer"]["count"] for b in one["batch_stats"]} == {1: 2, 3: 1}
    # its footprint on the one CPU worker, as measured at load (docs/MEMORY.md)
    usage = one["memory_usage"]
    assert [(m["type"], m["id"]) for m in usage] == [("CPU", 0)] and usage[0]["byte_size"] > 0
    assert inf["cache_hit"] == {"count": 0, "ns": 0}
    assert beta["inference_stats"]["success"]["count"] == 1 and beta["inference_count"] == 2
    assert triton.get_inference_statistics("mlp", "2")["model_stats"] == [beta]
    fails = triton.get_inference_statistics(model_name="fails")["model_stats"][0]["inference_stats"]
    assert fails["success"]["count"] == 1 and fails["fail"]["count"] == 1
    every = triton.get_inference_statistics()["model_stats"]
    assert [(s["name"], s["version"]) for s in every] == [("mlp", "1"), ("mlp", "2"), ("fails", "1"), ("twice", "1")]
    with pytest.raises(InferenceServerException, match="nope"):
        triton.get_inference_statistics(model_name="nope")


def test_pipeline_statistics(triton):
    infer(triton, "twice", np.ones((1, 2), np.float32))
    with pytest.raises(InferenceServerException):
        infer(triton, "twice", -np.ones((1, 2), np.float32))
    stats = triton.get_inference_statistics(model_name="twice")["model_stats"]
    assert stats[0]["inference_stats"]["success"]["count"] == 1
    assert stats[0]["inference_stats"]["fail"]["count"] == 1


def test_the_docs_example_runs_as_printed(triton, capsys):
    exec(readme_block("http-example:statistics"), {"c": triton})
    success, batch_stats = capsys.readouterr().out.split(" ", 1)
    assert int(success) >= 1 and "batch_size" in batch_stats
