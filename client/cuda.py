"""CUDA tensors by IPC handle, the client's part (docs/PROTOCOL.md section 5.10).

A caller on the broker's box may pass CUDA tensors as inputs: each travels as a CudaIpc
descriptor (TensorMeta.cuda, an empty frame) that the worker on the same GPU opens and reads in
place. It may also name CUDA buffers for outputs (`cuda_out={"y": tensor}`): the worker writes
its rows there, and the reply's meta for that output carries `cuda` and an empty frame; the call
returns the caller's own tensor for it.

torch is imported only by the functions that are handed torch tensors: importing this module
costs nothing to a numpy-only caller.

What the caller must keep: the tensors themselves until the reply. The call's CudaPlan holds
them for it. Each descriptor is one torch IPC share (Storage._share_cuda_, as
torch.multiprocessing's reduce_tensor makes it): a ref counter the worker decrements when it
drops what it opened, and the plan releases once more when the reply is in - so the caller's
block returns to its allocator as soon as the caller drops it. A call that ends without a reply
(timeout, cancel, lost connection) releases nothing: torch then keeps the block out of the
allocator (its "limbo") until the worker, should it still run the request, has dropped it - the
worker can never write into memory the caller has reused.
"""
from __future__ import annotations

from typing import Any

from tgw.shm.errors import Code, fail
from tgw.shm.wire import BYTES, DTYPE_SIZES, CudaIpc, TensorMeta


def is_cuda(value: Any) -> bool:
    """Whether `value` is a torch CUDA tensor (without importing torch)."""
    return type(value).__module__.startswith("torch") and getattr(value, "is_cuda", False) is True


def split(inputs: dict) -> tuple[dict, dict]:
    """(inputs that travel in frames, CUDA tensors that travel by handle)."""
    if not isinstance(inputs, dict):
        return inputs, {}
    host = {k: v for k, v in inputs.items() if not is_cuda(v)}
    if len(host) == len(inputs):
        return inputs, {}
    return host, {k: v for k, v in inputs.items() if k not in host}


def wire_dtype(tensor) -> str:
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise fail(Code.INVALID_INPUT_DTYPE, f"CUDA tensor has dtype {name}; tgw carries {', '.join(DTYPE_SIZES)}")
    return name


def describe(tensor, *, exact: bool = False) -> CudaIpc:
    """The CudaIpc descriptor of a C-contiguous CUDA tensor (one torch IPC share of its storage).

    `exact`: describe the tensor's own bytes as the storage (storage_bytes = its size,
    offset_bytes 0), as an output buffer is described, so the worker cannot write past it."""
    import torch  # only here: the caller handed us a torch tensor
    if not isinstance(tensor, torch.Tensor) or not tensor.is_cuda:
        got = f"a tensor on {tensor.device}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise fail(Code.INVALID_ARGUMENT, f"describe() takes a CUDA tensor, got {got}")
    wire_dtype(tensor)
    if not tensor.is_contiguous():
        raise fail(Code.INVALID_ARGUMENT, "a CUDA tensor sent by handle must be C-contiguous (call .contiguous())")
    if tensor.numel() == 0:
        raise fail(Code.INVALID_ARGUMENT, "a CUDA tensor with no elements has no memory to share; send an array")
    t = tensor.detach()
    storage = t.untyped_storage()
    # the 8-tuple torch.multiprocessing.reductions.reduce_tensor takes from a CUDA storage
    (device, handle, storage_bytes, storage_offset_bytes, ref_counter_handle, ref_counter_offset,
     event_handle, event_sync_required) = storage._share_cuda_()
    offset = t.storage_offset() * t.element_size()
    if exact:
        storage_offset_bytes, storage_bytes, offset = storage_offset_bytes + offset, t.numel() * t.element_size(), 0
    return CudaIpc(device=int(device), device_uuid=str(torch.cuda.get_device_properties(device).uuid),
                   handle=bytes(handle), storage_bytes=int(storage_bytes),
                   storage_offset_bytes=int(storage_offset_bytes), offset_bytes=offset,
                   ref_counter_handle=bytes(ref_counter_handle or b""), ref_counter_offset=int(ref_counter_offset),
                   event_handle=bytes(event_handle or b""), event_sync_required=bool(event_sync_required))


def release(d: CudaIpc) -> None:
    """Drop one reference of the share `d` describes (best effort: torch's own
    _release_ipc_counter, which rebuild_cuda_tensor calls for a share it already holds)."""
    if not d.ref_counter_handle:
        return
    import torch
    try:
        torch.UntypedStorage._release_ipc_counter_cuda(d.ref_counter_handle, d.ref_counter_offset)
    except Exception:
        pass


class CudaPlan:
    """What one call with CUDA tensors holds until its reply: the tensors, their descriptors and
    the caller's output buffers by name."""

    __slots__ = ("keep", "descs", "outputs", "released")

    def __init__(self) -> None:
        self.keep: list = []                 # the caller's tensors, alive until the call ends
        self.descs: list[CudaIpc] = []       # every share made for the call
        self.outputs: dict[str, Any] = {}    # output name -> the caller's CUDA buffer
        self.released = False

    def read(self, metas: list[TensorMeta], frames: list) -> tuple[list[TensorMeta], list, dict]:
        """Split a reply: (metas and frames of outputs in frames, {name: the caller's tensor} for
        outputs written into its CUDA buffers). The reply is in: the shares are released."""
        host_metas, host_frames, on_gpu = [], [], {}
        for meta, frame in zip(metas, frames):
            if meta.cuda is not None and meta.name in self.outputs:
                if meta.dtype == BYTES:
                    raise fail(Code.INTERNAL, f"output {meta.name!r} is a bytes tensor written into a CUDA buffer: "
                               "bytes outputs travel in frames, never by CUDA IPC handle", output=meta.name)
                on_gpu[meta.name] = _as_written(self.outputs[meta.name], meta)
            else:
                host_metas.append(meta)
                host_frames.append(frame)
        self.replied()
        return host_metas, host_frames, on_gpu

    def replied(self) -> None:
        """The call's reply (outputs or an error) is in: nothing will touch these tensors again."""
        if not self.released:
            self.released = True
            for d in self.descs:
                release(d)

    def end(self) -> None:
        """The call is over, however: stop holding the tensors (unreleased shares stay in
        torch's limbo until the worker has dropped them)."""
        self.keep.clear()


def _as_written(buf, meta: TensorMeta):
    """The caller's buffer as the output the worker wrote there: itself when it has the
    output's shape and dtype, else a view of its first bytes as that."""
    shape = list(meta.shape)
    if list(buf.shape) == shape and str(buf.dtype).removeprefix("torch.") == meta.dtype:
        return buf
    import torch
    from tgw.shm.wire import nbytes_of
    dtype = getattr(torch, meta.dtype)
    return buf.view(-1).view(torch.uint8)[:nbytes_of(meta.dtype, shape)].view(dtype).view(shape)


def place_cuda(call, inputs: dict, cuda_out: dict | None = None) -> CudaPlan:
    """Put a prepared call's CUDA inputs (name -> CUDA tensor) into its header as descriptors
    with empty frames, and its output buffers (`cuda_out`: output name -> CUDA tensor) into
    Infer.output_cuda. `call`: request.Call (msg, frames, declared). Returns the plan the call
    keeps until it ends."""
    plan = CudaPlan()
    for meta in call.msg.inputs if inputs else ():
        if meta.dtype == BYTES:   # the broker would refuse the mix; name the tensor here
            raise fail(Code.INVALID_ARGUMENT, f"input {meta.name!r} is a bytes tensor: bytes travel in frames, never "
                       "by CUDA IPC handle, and a request's inputs travel all by handle or none do (send "
                       f"{sorted(inputs)} from the host, or call a model that takes no bytes)", input=meta.name)
    for name, tensor in inputs.items():
        d = describe(tensor)
        plan.keep.append(tensor)
        plan.descs.append(d)
        call.msg.inputs.append(TensorMeta(name=name, dtype=wire_dtype(tensor), shape=list(tensor.shape), cuda=d))
        call.frames.append(b"")
        call.declared += tensor.numel() * tensor.element_size()
    if cuda_out:
        if not isinstance(cuda_out, dict):
            raise fail(Code.INVALID_ARGUMENT, "cuda_out must be a dict of output name -> CUDA tensor")
        placed = dict(call.msg.output_cuda)
        for name, tensor in cuda_out.items():
            if not is_cuda(tensor):
                raise fail(Code.INVALID_ARGUMENT, f"cuda_out[{name!r}] must be a CUDA tensor")
            d = describe(tensor, exact=True)
            plan.keep.append(tensor)
            plan.descs.append(d)
            plan.outputs[name] = tensor
            placed[name] = d
        call.msg.output_cuda = placed
    return plan
