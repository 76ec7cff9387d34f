"""CUDA workers: run wherever a CUDA device exists, skipped cleanly elsewhere."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import base_config
from tgw.client import Client

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")]


def test_cuda_worker_matches_cpu_reference(model_files, make_broker):
    b = make_broker(base_config(model_files, "mlp", "mixed", workers={"devices": ["cuda:0"]}))
    x = np.random.default_rng(3).standard_normal((8, 256), dtype=np.float32)
    ref = torch.jit.load(model_files["mlp"][0])(torch.from_numpy(x)).detach().numpy()
    with Client(b.address) as c:
        assert c.stats()["processes"][1]["device"] == "cuda:0"
        y = c.infer("mlp", {"x": x})["y"]
        out = c.infer("mixed", {"a": np.ones((2, 4), np.float16), "b": np.zeros((2, 3), bool),
                                "c": np.arange(10, dtype=np.int64).reshape(2, 5)})
    np.testing.assert_allclose(y, ref, rtol=1e-3, atol=1e-4)
    np.testing.assert_array_equal(out["csum"], [10, 35])


def test_auto_devices_use_every_gpu(model_files, make_broker):
    b = make_broker(base_config(model_files, "mlp", workers={"devices": "auto"}))
    with Client(b.address) as c:
        devices = [p["device"] for p in c.stats()["processes"] if p["role"] == "worker"]
    assert devices == [f"cuda:{i}" for i in range(torch.cuda.device_count())]
