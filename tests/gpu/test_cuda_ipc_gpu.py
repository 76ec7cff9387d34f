"""CUDA tensors by IPC handle (docs/PROTOCOL.md 5.10) end to end through a real broker with a GPU
worker: CUDA in, outputs in frames or in the caller's CUDA buffers (a view at an offset too); a
bad handle fails only its request. Runs wherever a CUDA device exists (scripts/gpu-check.sh),
skipped cleanly elsewhere. (Without a GPU: tests/inproc/test_cuda_ipc.py.)"""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch
import zmq

from conftest import base_config
from tgw.client import cuda as client_cuda
from tgw.shm.errors import Code
from tgw.shm.wire import PROTOCOL_VERSION, CudaIpc, Infer, TensorMeta, encode, reply_decoder

HAS_CUDA = torch.cuda.is_available()


def _raw_infer(address, model, inputs: dict, cuda_out: dict | None = None, outputs=None):
    """An infer over a raw DEALER with client/cuda.place_cuda (the hook Client.infer uses)."""
    from tgw.client.tensors import encode_inputs
    host, on_gpu = client_cuda.split(inputs)
    metas, frames = encode_inputs(host, False) if host else ([], [])
    call = types.SimpleNamespace(msg=Infer(v=PROTOCOL_VERSION, id=1, model=model, inputs=metas, outputs=outputs),
                                 frames=list(frames), declared=0)
    plan = client_cuda.place_cuda(call, on_gpu, cuda_out)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.connect(address)
        sock.send_multipart([encode(call.msg), *call.frames])
        assert sock.poll(30_000)
        parts = sock.recv_multipart()
    finally:
        sock.close(0)
    reply = reply_decoder.decode(parts[0])
    if getattr(reply, "error", None) is not None:
        plan.replied()
        raise AssertionError(reply.error)
    metas, frames, on_gpu = plan.read(reply.outputs, parts[1:])
    out = {m.name: np.frombuffer(f, np.dtype(m.dtype)).reshape(m.shape) for m, f in zip(metas, frames)}
    return {**out, **on_gpu}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device on this machine")
def test_cuda_tensor_in_cuda_buffer_out_end_to_end(model_files, make_broker):
    b = make_broker(base_config(model_files, "mlp", "double", workers={"devices": ["cuda:0"]}))
    x = torch.randn(8, 256, device="cuda:0")
    ref = torch.jit.load(model_files["mlp"][0]).to("cuda:0")(x)
    y = _raw_infer(b.address, "mlp", {"x": x})["y"]               # CUDA in, outputs in frames
    torch.testing.assert_close(torch.from_numpy(y.copy()).to("cuda:0"), ref, rtol=1e-3, atol=1e-4)
    buf = torch.full_like(ref, float("nan"))
    got = _raw_infer(b.address, "mlp", {"x": x}, {"y": buf})["y"]   # CUDA in, CUDA out
    assert got is buf
    torch.testing.assert_close(buf, ref, rtol=1e-3, atol=1e-4)
    d = torch.arange(12, dtype=torch.float32, device="cuda:0").view(3, 4)[1:]   # a view at an offset
    dbuf = torch.zeros(2, 4, device="cuda:0")
    _raw_infer(b.address, "double", {"x": d}, {"y": dbuf})
    torch.testing.assert_close(dbuf, 2 * d)
    host = _raw_infer(b.address, "double", {"x": np.ones((1, 4), np.float32)},
                      {"y": torch.zeros(1, 4, device="cuda:0")})
    torch.testing.assert_close(host["y"], torch.full((1, 4), 2.0, device="cuda:0"))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device on this machine")
def test_cuda_bad_handle_fails_only_that_request(model_files, make_broker):
    b = make_broker(base_config(model_files, "double", workers={"devices": ["cuda:0"]}))
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    bogus = CudaIpc(device=0, device_uuid=uuid, handle=b"\x00" * 64, storage_bytes=64, storage_offset_bytes=0)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.connect(b.address)
        msg = Infer(v=PROTOCOL_VERSION, id=2, model="double",
                    inputs=[TensorMeta(name="x", dtype="float32", shape=[1, 4], cuda=bogus)])
        sock.send_multipart([encode(msg), b""])
        assert sock.poll(30_000)
        reply = reply_decoder.decode(sock.recv_multipart()[0])
    finally:
        sock.close(0)
    assert reply.error.code == Code.INVALID_ARGUMENT.value, reply
    y = _raw_infer(b.address, "double", {"x": torch.ones(1, 4, device="cuda:0")})["y"]   # still serving
    np.testing.assert_array_equal(y, np.full((1, 4), 2.0, np.float32))
