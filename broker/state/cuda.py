"""A request's binding to a GPU (CUDA tensors by IPC handle, docs/PROTOCOL.md section 5.10): the
record front/cuda_route.py makes at the door, and the rules by which a worker may take it.

A bound request's shape_key ends in a tag, so it batches only with requests of its GPU and kind.
"""
from __future__ import annotations

from tgw.shm.devices import norm_uuid
from tgw.shm.wire import Batch, CudaIpc

TAG = "cuda"   # shape_key's last item for a request bound to a GPU: (TAG, index, uuid, "in" | "out")


class CudaRequest:
    """What binds one request to a GPU: the device, its inputs' descriptors (declared order, once
    bound; None when its inputs travel in frames) and its output buffers by name."""
    __slots__ = ("device", "uuid", "inputs", "outputs")

    def __init__(self, device: int, uuid: str, inputs: list[CudaIpc] | None, outputs: dict[str, CudaIpc]):
        self.device, self.uuid, self.inputs, self.outputs = device, uuid, inputs, outputs

    @property
    def tag(self) -> tuple:
        return (TAG, self.device, self.uuid, "in" if self.inputs is not None else "out")


def on_device(w, device: int, uuid: str) -> bool:
    """Whether worker `w` (pool.WorkerHandle) runs on that GPU: by UUID once the worker said it,
    else by index ("cuda:N" in the broker box's numbering)."""
    if uuid and getattr(w, "device_uuid", ""):
        return norm_uuid(uuid) == norm_uuid(w.device_uuid)
    return w.device == f"cuda:{device}"


def dims(shape_key: tuple) -> tuple:
    """A shape_key without its GPU tag: the variable dims of each input (() for fixed shapes)."""
    if shape_key and type(shape_key[-1]) is tuple and shape_key[-1][:1] == (TAG,):
        return shape_key[:-1]
    return shape_key


def fits(w, p) -> bool:
    """Whether worker `w` may run request `p` (any worker, unless `p` is bound to a GPU)."""
    cuda = getattr(p, "cuda", None)
    return cuda is None or on_device(w, cuda.device, cuda.uuid)


def attach(batch: Batch, requests: list) -> Batch:
    """The batch's CUDA descriptors, per request in order (pool.WorkerHandle.stage)."""
    cuda = getattr(requests[0], "cuda", None)
    if cuda is not None:
        if cuda.inputs is not None:
            batch.cuda_inputs = [p.cuda.inputs for p in requests]
        if any(p.cuda.outputs for p in requests):
            batch.cuda_outputs = [p.cuda.outputs for p in requests]
    return batch
