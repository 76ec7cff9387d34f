"""CUDA tensors by IPC handle (docs/PROTOCOL.md 5.10) sent to a real broker with CPU workers only:
refused, naming the device no worker is on. (The wire, routing and the worker's batch path:
tests/inproc/test_cuda_ipc.py; end to end on a GPU: tests/gpu/test_cuda_ipc_gpu.py.)"""
from __future__ import annotations

import zmq

from conftest import base_config
from tgw.shm.errors import Code
from tgw.shm.wire import PROTOCOL_VERSION, CudaIpc, Infer, TensorMeta, encode, reply_decoder


def ipc(device: int = 0, uuid: str = "u-0", nbytes: int = 4096, offset: int = 0) -> CudaIpc:
    """A descriptor as the client's would be (tests/inproc/test_cuda_ipc.py's): no real handle."""
    return CudaIpc(device=device, device_uuid=uuid, handle=b"\x01" * 64, storage_bytes=nbytes,
                   storage_offset_bytes=0, offset_bytes=offset, ref_counter_handle=b"/torch_1_2_3",
                   ref_counter_offset=7, event_handle=b"\x02" * 64, event_sync_required=True)


def test_broker_refuses_cuda_inputs_without_a_worker_on_that_gpu(model_files, make_broker):
    b = make_broker(base_config(model_files, "double"))
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(b.address)
        msg = Infer(v=PROTOCOL_VERSION, id=9, model="double",
                    inputs=[TensorMeta(name="x", dtype="float32", shape=[2, 3], cuda=ipc(nbytes=24))])
        sock.send_multipart([encode(msg), b""])
        assert sock.poll(10_000)
        reply = reply_decoder.decode(sock.recv_multipart()[0])
    finally:
        sock.close(0)
    assert reply.id == 9 and reply.error.code == Code.INVALID_ARGUMENT.value
    assert reply.error.details["reason"] == "no_worker_on_device" and "cuda:0" in reply.error.message
