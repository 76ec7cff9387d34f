"""A `device: cuda` stage on a GPU worker (skipped cleanly where there is no CUDA device): its
input tensors reach it on the GPU, its outputs come back; a cpu stage beside it runs on the
stage worker (workers.stage_workers), never on the GPU worker."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

import stages
from conftest import model_entry
from tgw.client import Client

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")]


def test_a_cuda_stage_runs_on_the_gpu_worker(model_files, make_broker, short_dir):
    os.makedirs(os.path.join(short_dir, "stages"))
    shutil.copy(stages.__file__, os.path.join(short_dir, "stages", "stages.py"))
    handler = "stages/stages.py"
    cfg = {"model_roots": [short_dir, os.path.dirname(model_files["mlp"][0])],
           "workers": {"devices": ["cuda:0"], "stage_workers": 1, "input_arena_mb": 4, "output_arena_mb": 2},
           "models": [model_entry(model_files, "mlp"),
                      stages.stage_entry(handler, "OnDevice", device="cuda"),
                      stages.stage_entry(handler, "Echo")]}
    b = make_broker(cfg)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    with Client(b.address) as c:
        out = c.infer("ondevice", {"x": x})
        workers = {w["device"]: w for w in c.status()["workers"]}
        assert c.infer("echo", {"data": [b"cpu"]})["length"].tolist() == [3]
    np.testing.assert_array_equal(out["y"], x * 2)
    assert [bytes(v) for v in np.asarray(out["where"], dtype=object)] == [b"cuda:0", b"cuda:0"]
    assert workers["cuda:0"]["models"] == ["mlp:1", "ondevice:1"] and workers["cuda:0"]["role"] == "models"
    assert workers["cpu"]["models"] == ["echo:1"] and workers["cpu"]["role"] == "stages"
