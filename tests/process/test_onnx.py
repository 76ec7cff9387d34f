"""ONNX models end to end: a broker serving an ONNX model beside the demo mlp exported by
torch.onnx.export (dynamo), told from their files; answers equal onnxruntime's in this process;
versions hot-swapped under load with no failed request and no reply going back a version
(tgw.testing.lifecycle's swap rig); runtime loads of a file tgw cannot serve refused with the
reason and the old version serving on; `tgw-broker check-config` naming a file that is not an
ONNX model, and weights missing beside one, without onnxruntime in the broker."""
from __future__ import annotations

import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch
import yaml

from tgw.client import Client, TgwError
from tgw.shm.errors import Code
from tgw.shm.wire import LoadVersion
from tgw.testing.child import BrokerProc
from tgw.testing.lifecycle import control, model_decl, swap, version_of
from tgw.workers.demo_models import DEMO_MODELS, build_file
from tgw.workers.formats import load_in_process

pytest.importorskip("onnxruntime")
from tgw.testing.onnx_models import add_model  # noqa: E402

X = np.zeros((1, 4), np.float32)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    d = tmp_path_factory.mktemp("onnx_models")
    for k in range(1, 4):
        add_model(str(d / f"add{k}.onnx"), k)
    add_model(str(d / "fixed.onnx"), 9, batch=1)
    (d / "junk.onnx").write_bytes(b"#!/bin/sh\necho not a model\n")
    build_file(str(d), "mlp", "onnx")
    return d


@pytest.fixture(scope="module")
def served(root):
    mlp = str(root / "mlp-onnx-v1.onnx")
    cfg = {"model_roots": [str(root)],
           "workers": {"devices": ["cpu"], "input_arena_mb": 8, "output_arena_mb": 8},
           "models": [model_decl("m", [("1", str(root / "add1.onnx"))]),
                      {"name": "mlp", "versions": [{"version": "1", "path": mlp, "format": "onnx"}],
                       **DEMO_MODELS["mlp"][2]}]}
    b = BrokerProc(cfg, tempfile.mkdtemp(prefix="tgwo-", dir="/tmp")).start(timeout=120)
    yield b
    assert b.stop() == 0, b.output()


def test_onnx_models_serve_swap_under_load_and_refuse_what_they_cannot(served, root):
    a = served.address
    x = np.random.default_rng(0).standard_normal((3, 256), dtype=np.float32)
    with Client(a) as c:
        y = c.infer("mlp", {"x": x})["y"]
        assert version_of(X, c.infer("m", {"x": X})["y"]) == 1
        workers = c.status()["workers"][0]["models"]
    want = load_in_process("onnx", str(root / "mlp-onnx-v1.onnx")).call(torch.from_numpy(x))[0].numpy()
    assert np.allclose(y, want, atol=1e-5) and sorted(workers) == ["m:1", "mlp:1"]

    # a file tgw cannot serve: refused with the reason, version 1 serving on
    with pytest.raises(TgwError) as info:
        control(a, LoadVersion(v=0, model="m", version="2", path=str(root / "junk.onnx")))
    assert info.value.code is Code.INVALID_ARGUMENT and "junk.onnx is not an ONNX model" in info.value.message
    with pytest.raises(TgwError) as info:
        control(a, LoadVersion(v=0, model="m", version="2", path=str(root / "fixed.onnx")))
    assert "static batch dim of 1 in the model" in info.value.message, info.value.message
    assert "export it with a dynamic batch dim" in info.value.message

    # hot swap under load: every reply names its version (x + k), none fails or goes back
    r = swap(a, "m", [("2", str(root / "add2.onnx")), ("3", str(root / "add3.onnx"))], concurrency=8,
             duration_s=3.0, per_phase=50)
    assert r["failed"] == 0 and r["backward_count"] == 0, r
    assert set(r["by_version"]) == {"1", "2", "3"}, r
    with Client(a) as c:
        assert sorted(c.status()["workers"][0]["models"]) == ["m:3", "mlp:1"]   # the old versions unloaded
        assert c.stats()["models"]["m"]["requests"] >= r["ok"]


def test_check_config_names_files_that_are_not_onnx_models(root, tmp_path):
    add_model(str(tmp_path / "ext.onnx"), 1, external=True)
    (tmp_path / "ext.onnx.data").unlink()
    (tmp_path / "junk.onnx").write_bytes((root / "junk.onnx").read_bytes())
    cfg = {"model_roots": [str(tmp_path)], "workers": {"devices": ["cpu"]},
           "models": [model_decl("a", [("1", str(tmp_path / "junk.onnx"))]),
                      model_decl("b", [("1", str(tmp_path / "ext.onnx"))])]}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    r = subprocess.run([sys.executable, "-m", "tgw.broker", "check-config", str(tmp_path / "c.yaml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "models.0.versions.0.path: " + str(tmp_path / "junk.onnx") + " is not an ONNX model" in r.stderr, r.stderr
    assert "models.1.versions.0.path: " in r.stderr and "its weights lie in 'ext.onnx.data' (external data), " \
        "which is not beside it" in r.stderr, r.stderr
