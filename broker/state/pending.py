"""One admitted request as the broker holds it, from admission to its answer."""
from __future__ import annotations

from typing import Any


class Pending:
    """One admitted request waiting for, or riding in, a batch."""

    __slots__ = ("client", "req_id", "model", "version", "rows", "shape_key", "tensors", "nbytes",
                 "out_nbytes", "outputs", "deadline", "compress", "attempts", "alone", "priority", "arrived",
                 "tenant", "dispatched", "in_total", "out_total", "record", "compute_us", "trace", "output_region",
                 "cuda")

    def __init__(self, *, client: Any, req_id: int, model: str, version: str, rows: int, shape_key: tuple,
                 tensors: list, outputs: list[str], deadline: float, compress: bool = False,
                 out_nbytes: list[int] | None = None, priority: int = 0, arrived: float = 0.0,
                 tenant: Any = None, record: Any = None):
        self.client, self.req_id, self.model, self.version = client, req_id, model, version
        self.rows, self.shape_key, self.outputs = rows, shape_key, outputs
        self.tensors = tensors                      # buffers in declared input order
        self.nbytes = [len(t) for t in tensors]     # per declared input
        # per declared output (the worker writes them all), for its rows; None: some dim is -1,
        # so the size is known only after compute
        self.out_nbytes = out_nbytes
        self.in_total = sum(self.nbytes)
        self.out_total = None if out_nbytes is None else sum(out_nbytes)
        self.deadline, self.compress = deadline, compress   # deadline: clock seconds
        self.attempts = 0                           # dispatches lost to a dying worker
        self.alone = False                          # runs in a batch of its own (a retry after a death)
        self.priority = priority                    # 0 is the highest level
        self.arrived = arrived                      # clock seconds at admission
        self.tenant = tenant                        # the quota it counts against (tenants.Tenant) or None
        self.dispatched = 0.0                       # clock seconds it was handed to a worker (0: queued)
        self.record = record                        # its version's record (versions.VersionRecord)
        self.compute_us = 0                         # its batch's compute time, as the worker measured it
        self.trace = None                           # its W3C traceparent, when the caller sent one
        self.cuda = None                            # its GPU binding (state/cuda.py CudaRequest), if any
        self.output_region = None                   # the caller's RegionSlice for its outputs (regions.py)

    def group(self) -> tuple:
        return (self.version, self.shape_key)


def is_step(client: Any) -> bool:
    """Whether a request's client is a pipeline's step (pipeline/run.py StepCaller), not a caller:
    its run was admitted, counted and charged at the pipeline's entry. A socket identity is bytes."""
    return type(client) is not bytes and getattr(client, "internal", False)
