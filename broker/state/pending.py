"""One admitted request as the broker holds it, from admission to its answer, and its binding
to a GPU when it names CUDA tensors by IPC handle (docs/PROTOCOL.md section 5.10): the record
front/cuda_route.py makes at the door, and the rules by which a worker may take it. A bound
request's shape_key ends in a tag, so it batches only with requests of its GPU and kind."""
from __future__ import annotations

from typing import Any, Optional

import msgspec

from tgw.shm.devices import norm_uuid
from tgw.shm.wire import Batch, CudaIpc


class Pending(msgspec.Struct, kw_only=True, eq=False):
    """One admitted request waiting for, or riding in, a batch. A Struct: built in C (admission
    makes one per request), compared and hashed by identity (eq=False), like a plain object."""
    client: Any
    req_id: int
    model: str
    version: str
    rows: int
    shape_key: tuple
    tensors: list                   # buffers in declared input order
    outputs: list
    deadline: float                 # clock seconds
    compress: Any = False
    # per declared output (the worker writes them all), for its rows; None: some dim is -1, so
    # the size is known only after compute
    out_nbytes: Optional[list] = None
    priority: int = 0               # 0 is the highest level
    arrived: float = 0.0            # clock seconds at admission
    tenant: Any = None              # the quota it counts against (tenants.Tenant) or None
    record: Any = None              # its version's record (versions.VersionRecord)
    nbytes: list = []               # per declared input (set from tensors)
    in_total: int = 0
    out_total: Optional[int] = None
    attempts: int = 0               # dispatches lost to a dying worker
    alone: bool = False             # runs in a batch of its own (a retry after a death)
    batched: bool = True            # False: its model has no batch dim (max_batch_size 0): answered without one
    # clock seconds it was handed to a worker; None: never (queued, a cache hit) or taken back from
    # one (withdrawn: its latency is nobody's, so latency figures and the breaker skip it)
    dispatched: Optional[float] = None
    compute_us: int = 0             # its batch's compute time, as the worker measured it
    trace: Optional[str] = None     # its W3C traceparent, when the caller sent one
    cuda: Any = None                # its GPU binding (CudaRequest, below), if any
    output_region: Any = None       # the caller's RegionSlice for its outputs (regions.py)
    # its model's response cache (cache/responses.py): the outputs a hit answers with (never queued),
    # or on a miss (the cache, key, epoch) its computed answer is kept under
    cache_hit: Optional[dict] = None
    cache_miss: Optional[tuple] = None
    # a generation (docs/GENERATION.md): its sequence as its worker gets it (GenSeq); None: answered once
    generate: Any = None
    # a sequence model's step (broker/sequence/binding.py Step): its sequence and flags; None: stateless
    sequence: Any = None

    def __post_init__(self) -> None:
        self.nbytes = nbytes = [len(t) for t in self.tensors]
        self.in_total = sum(nbytes)
        out = self.out_nbytes
        self.out_total = None if out is None else sum(out)

    def dispatch(self, now: float) -> None:
        """Handed to a worker in a batch, now."""
        self.dispatched = now

    def take_back(self) -> None:
        """Withdrawn from its batch on a worker: it counts as never dispatched."""
        self.dispatched = None

    def group(self) -> tuple:
        return (self.version, self.shape_key)


def is_shadow(client: Any) -> bool:
    """Whether a request is a shadow version's copy of another's (canary/shadow.py ShadowCaller)."""
    return type(client) is not bytes and getattr(client, "shadow", False)


def is_step(client: Any) -> bool:
    """Whether a request's client is a pipeline's step (pipeline/run.py StepCaller), not a caller:
    its run was admitted, counted and charged at the pipeline's entry. A socket identity is bytes."""
    return type(client) is not bytes and getattr(client, "internal", False)


# ---- a request's binding to a GPU ----------------------------------------------------------

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


def plain_dims(shape_key: tuple) -> tuple:
    """A shape_key without its GPU tag: the variable dims of each input (() for fixed shapes)."""
    if shape_key and type(shape_key[-1]) is tuple and shape_key[-1][:1] == (TAG,):
        return shape_key[:-1]
    return shape_key


def gpu_fits(w, p) -> bool:
    """Whether worker `w` may run request `p` (any worker, unless `p` is bound to a GPU)."""
    cuda = getattr(p, "cuda", None)
    return cuda is None or on_device(w, cuda.device, cuda.uuid)


def attach_cuda(batch: Batch, requests: list) -> Batch:
    """The batch's CUDA descriptors, per request in order (pool.WorkerHandle.stage)."""
    cuda = getattr(requests[0], "cuda", None)
    if cuda is not None:
        if cuda.inputs is not None:
            batch.cuda_inputs = [p.cuda.inputs for p in requests]
        if any(p.cuda.outputs for p in requests):
            batch.cuda_outputs = [p.cuda.outputs for p in requests]
    return batch
