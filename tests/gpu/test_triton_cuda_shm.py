"""Triton's CUDA shared memory over HTTP on a CUDA worker (docs/SHARED_MEMORY.md): regions made
and read by tritonclient.utils.cuda_shared_memory, registered by tritonclient.http, served by the
CUDA IPC path; results equal to the native client's. Skipped without CUDA (or cuda-python)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import base_config
from tgw.client import Client

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")]
REGION_BYTES = 1 << 16
Y_AT = 8192   # the output's offset in the region


def test_cuda_regions_in_and_out_equal_native(model_files, make_broker):
    cudashm = pytest.importorskip("tritonclient.utils.cuda_shared_memory")
    httpclient = pytest.importorskip("tritonclient.http")
    cfg = base_config(model_files, "mlp", workers={"devices": ["cuda:0"]})
    cfg["http"] = {"port": 0, "allow_client_shm": True}
    b = make_broker(cfg)
    x = np.random.default_rng(9).standard_normal((4, 256), dtype=np.float32)
    with Client(b.address) as c:
        want = c.infer("mlp", {"x": x})["y"]
        http = c.status()["http"]
    t = httpclient.InferenceServerClient(http.removeprefix("http://"))
    handle = cudashm.create_shared_memory_region("g", REGION_BYTES, 0)
    try:
        cudashm.set_shared_memory_region(handle, [x])
        t.register_cuda_shared_memory("g", cudashm.get_raw_handle(handle), 0, REGION_BYTES)
        assert t.get_cuda_shared_memory_status() == [{"name": "g", "device_id": 0, "byte_size": REGION_BYTES}]
        for x_in_region, y_in_region in ((True, True), (True, False), (False, True)):
            inp = httpclient.InferInput("x", list(x.shape), "FP32")
            if x_in_region:
                inp.set_shared_memory("g", x.nbytes)
            else:
                inp.set_data_from_numpy(x)
            out = httpclient.InferRequestedOutput("y", binary_data=True)
            if y_in_region:
                out.set_shared_memory("g", want.nbytes, Y_AT)
            result = t.infer("mlp", [inp], outputs=[out])
            if y_in_region:
                flat = cudashm.get_contents_as_numpy(handle, np.uint8, [REGION_BYTES])
                got = flat[Y_AT:Y_AT + want.nbytes].view(np.float32).reshape(want.shape)
                assert result.get_output("y")["parameters"]["shared_memory_region"] == "g"
            else:
                got = result.as_numpy("y")
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        t.unregister_cuda_shared_memory("g")
        assert t.get_cuda_shared_memory_status() == []
    finally:
        t.close()
        cudashm.destroy_shared_memory_region(handle)
