"""One admitted request as the broker holds it, from admission to its answer."""
from __future__ import annotations

from typing import Any, Optional

import msgspec


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
    # clock seconds it was handed to a worker; None: never (queued, a cache hit) or taken back from
    # one (withdrawn: its latency is nobody's, so latency figures and the breaker skip it)
    dispatched: Optional[float] = None
    compute_us: int = 0             # its batch's compute time, as the worker measured it
    trace: Optional[str] = None     # its W3C traceparent, when the caller sent one
    cuda: Any = None                # its GPU binding (state/cuda.py CudaRequest), if any
    output_region: Any = None       # the caller's RegionSlice for its outputs (regions.py)
    # its model's response cache (cache/responses.py): the outputs a hit answers with (never queued),
    # or on a miss (the cache, key, epoch) its computed answer is kept under
    cache_hit: Optional[dict] = None
    cache_miss: Optional[tuple] = None

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
