"""What the clients return: an infer call's outputs with the broker's word on the run, and the
control replies (models, health, stats, status) as plain dicts."""
from __future__ import annotations

from typing import Any, NamedTuple


class InferResult(NamedTuple):
    """Client.infer_with_meta's answer."""
    outputs: dict[str, Any]     # as infer returns them
    model: str                  # the model that ran: a breaker's fallback while the one asked for is open
    version: str                # the version that ran: the traffic split's pick when none was named
    traceparent: str | None     # the broker's request span (tracing on), else the one sent, if any


def model_dict(m) -> dict:
    io = lambda ts: [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in ts]  # noqa: E731
    return {"name": m.name, "versions": list(m.versions), "default_version": m.default_version,
            "max_batch_size": m.max_batch_size, "inputs": io(m.inputs), "outputs": io(m.outputs),
            "ready": m.ready, "wire_dtypes": list(m.wire_dtypes), "steps": list(m.steps)}


def health_dict(r) -> dict:
    return {"live": r.live, "ready": r.ready, "models": dict(r.models), "workers": dict(r.workers),
            "devices": dict(r.devices)}


def stats_dict(r) -> dict:
    return {"models": r.models, "processes": r.processes, "errors": r.errors, "refused": r.refused,
            "dropped": r.dropped, "clients": r.clients, "tenants": r.tenants, "abandoned": r.abandoned,
            "regions": r.regions, "cancelled": r.cancelled}


def status_dict(r) -> dict:
    return {"phase": r.phase, "uptime_s": r.uptime_s, "workers": r.workers, "models": r.models,
            "snapshots": r.snapshots, "reload": r.reload, "events": r.events, "http": r.http,
            "grpc": r.grpc, "torchserve": r.torchserve, "pipelines": r.pipelines, "devices": r.devices, "cuda_faults": r.cuda_faults,
            "rollouts": r.rollouts, "jobs": r.jobs,
            "fronts": r.fronts,
            "gc": r.gc}
