"""CUDA workers: run wherever a CUDA device exists, skipped cleanly elsewhere."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import base_config
from tgw.client import Client

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")]


@pytest.mark.parametrize("host_memory", ["register", "staging", "pageable"])
def test_cuda_worker_matches_cpu_reference(model_files, make_broker, host_memory):
    b = make_broker(base_config(model_files, "mlp", "mixed",
                                workers={"devices": ["cuda:0"], "cuda_host_memory": host_memory}))
    x = np.random.default_rng(3).standard_normal((8, 256), dtype=np.float32)
    ref = torch.jit.load(model_files["mlp"][0])(torch.from_numpy(x)).detach().numpy()
    with Client(b.address) as c:
        worker = c.stats()["processes"][1]
        assert worker["device"] == "cuda:0"
        assert worker["host_memory"] == host_memory   # the mode in effect: no silent fall-back to staging
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


def test_cuda_visible_devices_decides_what_auto_starts(model_files, make_broker):
    """The broker reads CUDA_VISIBLE_DEVICES as CUDA does: the last GPU alone, then none."""
    last = torch.cuda.device_count() - 1
    for sub, env, expect in (("one", str(last), ["cuda:0"]), ("none", "", ["cpu"])):
        b = make_broker(base_config(model_files, "mlp", workers={"devices": "auto"}), start=False, sub=sub)
        b.start(env={"CUDA_VISIBLE_DEVICES": env})
        with Client(b.address) as c:
            assert [p["device"] for p in c.stats()["processes"] if p["role"] == "worker"] == expect
            assert c.infer("mlp", {"x": np.ones((1, 256), np.float32)})["y"].shape == (1, 10)


def test_export_and_aoti_programs_serve_on_a_cuda_worker(tmp_path, make_broker):
    """An exported program made on the CPU is moved to the worker's device; an AOTInductor
    package compiled for the CPU is refused there, naming why; one compiled for CUDA serves."""
    from tgw.workers.demo_models import DEMO_MODELS, MLP, build_file, cxx_compiler, dynamic_shapes, save_model
    io_decl = DEMO_MODELS["mlp"][2]
    export = build_file(str(tmp_path), "mlp", "export")
    paths = {"mlp-export": export}
    if cxx_compiler() is not None:
        torch.manual_seed(1234)
        paths["mlp-aoti-cuda"] = save_model(MLP().eval().cuda(), (torch.randn(4, 256, device="cuda"),),
                                            str(tmp_path / "mlp-aoti-cuda.pt2"), "aoti", dynamic_shapes(io_decl, 64))
    models = [{"name": n, "versions": [{"version": "1", "path": p}], **io_decl} for n, p in paths.items()]
    b = make_broker({"model_roots": ["/"], "models": models, "workers": {"devices": ["cuda:0"]}})
    x = np.random.default_rng(4).standard_normal((8, 256), dtype=np.float32)
    from tgw.workers.formats import load_in_process
    with torch.inference_mode():
        ref = load_in_process("export", export).call(torch.from_numpy(x)).numpy()
    with Client(b.address) as c:
        for name in paths:
            np.testing.assert_allclose(c.infer(name, {"x": x})["y"], ref, rtol=1e-3, atol=1e-4, err_msg=name)
    if cxx_compiler() is not None:
        from tgw.shm.wire import IOSpec, ModelSpec
        from tgw.workers.formats import FormatMismatch
        from tgw.workers.runner import ModelRunner
        spec = ModelSpec(name="m", version="1", path=build_file(str(tmp_path), "mlp", "aoti"), format="aoti",
                         inputs=[IOSpec(**t) for t in io_decl["inputs"]],
                         outputs=[IOSpec(**t) for t in io_decl["outputs"]], max_batch_size=64)
        with pytest.raises(FormatMismatch, match="compiled for cpu; this worker runs on cuda:0"):
            ModelRunner(spec, torch.device("cuda:0"))
