"""CUDA tensors by IPC handle, the broker's part (docs/PROTOCOL.md section 5.10).

A caller on this box may send a CUDA tensor as a CudaIpc descriptor (TensorMeta.cuda, empty
frame) and name CUDA buffers for outputs (Infer.output_cuda). The broker never touches those
bytes (no torch here): it checks who may send them, binds the request to the GPU they live on,
batches it only with requests of that GPU and kind, hands it only to a worker on that GPU, and
passes the descriptors on in the Batch (workers/cuda_ipc.py opens them).

The request's tensors that travel by handle count for every size check as their declared
bytes (`Declared` frames), and take no input-arena bytes (their Pending.nbytes are 0).
"""
from __future__ import annotations

from tgw.shm.devices import norm_uuid
from tgw.shm.errors import Code, fail
from tgw.shm.wire import BYTES, DTYPE_SIZES, Infer, TensorMeta, nbytes_of

from tgw.broker.state.pending import CudaRequest, on_device

from .peers import is_local

# the header a face passes for a request whose CUDA tensors are regions registered with the
# broker (Triton's CUDA shared memory, protocol/triton_shm.py): the registry vouches that they are
# this box's, whichever transport the request itself came over
REGISTERED = object()


class Declared:
    """Stands in for the empty frame of a tensor that travels by CUDA IPC handle: as long as the
    tensor's declared bytes for the size checks, and no bytes for the ring."""
    __slots__ = ("nbytes",)
    buffer = memoryview(b"")

    def __init__(self, nbytes: int):
        self.nbytes = nbytes

    def __len__(self) -> int:
        return self.nbytes


def _refuse(message: str, reason: str, **details):
    return fail(Code.INVALID_ARGUMENT, message, reason=reason, **details)


def inspect(roster: list, models: dict, msg: Infer, frames: list, header=None) -> tuple[CudaRequest | None, list]:
    """(the request's GPU binding, the frames admission should size) - (None, frames) when the
    request names no CUDA tensor. `roster`: the workers; `models`: the registry's; `header`: the
    header frame (None from the HTTP face). Raises the INVALID_ARGUMENT a CUDA request gets when
    it cannot be served here."""
    if not msg.output_cuda:
        for t in msg.inputs:   # a plain loop: no list or generator per request
            if t.cuda is not None:
                break
        else:
            return None, frames
    cuda_in = [t.cuda for t in msg.inputs]
    if header is not REGISTERED and not is_local(header):
        raise _refuse("CUDA tensors by IPC handle are accepted only from processes on the broker's box (ipc://); "
                      "this request came over tcp:// or HTTP, where a handle means nothing", "cuda_remote_peer")
    if any(c is None for c in cuda_in) and any(c is not None for c in cuda_in):
        raise _refuse("a request's inputs travel all by CUDA IPC handle or none do", "cuda_mixed")
    named = [t for t in msg.inputs if t.cuda is not None]
    for t in named:
        _check_input(t)
    for name in msg.output_cuda:
        if msg.outputs is not None and name not in msg.outputs:
            raise _refuse(f"output_cuda names {name!r}, which the request does not ask for ({msg.outputs})",
                          "cuda_output_unknown", output=name)
    entry = models.get(msg.model)
    if entry is not None:
        known = {t.name for t in entry.outputs}
        unknown = sorted(set(msg.output_cuda) - known)
        if unknown:
            raise _refuse(f"output_cuda names {unknown}; model {msg.model!r} has outputs {sorted(known)}",
                          "cuda_output_unknown", output=unknown[0])
        carried = sorted(t.name for t in entry.outputs if t.dtype == BYTES and t.name in msg.output_cuda)
        if carried:
            raise _refuse(f"output_cuda names {carried}: bytes outputs of {msg.model!r}, which travel in frames, "
                          "never by CUDA IPC handle", "cuda_bytes", output=carried[0])
    descs = [t.cuda for t in named] + list(msg.output_cuda.values())
    for d in descs:
        if d.device < 0 or not d.handle or min(d.storage_bytes, d.storage_offset_bytes, d.offset_bytes) < 0:
            raise _refuse("a CUDA IPC descriptor has no handle or a negative device, size or offset", "cuda_bad_handle")
    devices = {(d.device, norm_uuid(d.device_uuid)) for d in descs}
    if len(devices) > 1:
        raise _refuse(f"a request's CUDA tensors must all live on one GPU; these are on {sorted(devices)}",
                      "cuda_devices_differ")
    device, uuid = devices.pop()
    if not any(on_device(w, device, uuid) for w in roster):
        where = f"cuda:{device}" + (f" (uuid {uuid})" if uuid else "")
        raise _refuse(f"no worker runs on {where}, the GPU this request's CUDA tensors live on; workers: "
                      f"{sorted({w.device for w in roster})}", "no_worker_on_device", device=f"cuda:{device}",
                      device_uuid=uuid)
    sized = [Declared(_declared(t)) if t.cuda is not None else f for t, f in zip(msg.inputs, frames)] \
        if named else frames
    inputs = {t.name: t.cuda for t in named} if named else None
    return CudaRequest(device, uuid, inputs, dict(msg.output_cuda)), sized  # inputs: by name until bound


def _declared(t: TensorMeta) -> int:
    """A CUDA tensor's bytes for the size checks (an unknown dtype: 0, admission names it)."""
    return max(0, nbytes_of(t.dtype, t.shape)) if t.dtype in DTYPE_SIZES else 0


def _check_input(t: TensorMeta) -> None:
    if t.dtype == BYTES:
        raise _refuse(f"input {t.name!r} is a bytes tensor: its layout travels in its frame, never by CUDA IPC "
                      "handle", "cuda_bytes", input=t.name)
    if t.compression is not None or t.wire_dtype is not None or t.region is not None:
        raise _refuse(f"input {t.name!r} travels by CUDA IPC handle: it takes no compression, wire_dtype "
                      "or region", "cuda_input_options", input=t.name)
    if t.dtype in DTYPE_SIZES and all(d >= 0 for d in t.shape):
        need = nbytes_of(t.dtype, t.shape)
        if t.cuda.offset_bytes + need > t.cuda.storage_bytes:
            raise _refuse(f"input {t.name!r}: shape {t.shape} x {t.dtype} needs {need} bytes from byte "
                          f"{t.cuda.offset_bytes} of its CUDA storage, which holds {t.cuda.storage_bytes}",
                          "cuda_bad_handle", input=t.name)


def bind(models: dict, p, cuda: CudaRequest | None) -> None:
    """Bind an admitted request (batcher.Pending) to its GPU: its descriptors, in the model's
    declared input order, and a shape_key that batches it only with requests of that GPU and
    kind (CUDA inputs, or frames in and CUDA buffers out)."""
    if cuda is None:
        return
    if cuda.inputs is not None:
        by_name = cuda.inputs
        cuda.inputs = [by_name[t.name] for t in models[p.model].inputs]
    cuda.outputs = {name: d for name, d in cuda.outputs.items() if name in p.outputs}
    p.cuda = cuda
    p.shape_key = (*p.shape_key, cuda.tag)


def mark_outputs(p, metas: list[TensorMeta], payload: list) -> None:
    """A reply's outputs the worker wrote into the caller's CUDA buffers: meta.cuda set (the
    caller's own descriptor), an empty frame."""
    cuda = getattr(p, "cuda", None)
    if cuda is None or not cuda.outputs:
        return
    for i, meta in enumerate(metas):
        d = cuda.outputs.get(meta.name)
        if d is not None:
            meta.cuda, meta.compression = d, None
            payload[i] = b""

