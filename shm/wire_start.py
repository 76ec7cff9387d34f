"""The worker's start-up contract: everything the supervisor tells a worker it spawns, in one Struct.

It travels as the worker's one command-line argument, JSON: argv is there before the process
runs any code (stdin would need a pipe written after the spawn and closed, and a worker
started by hand would need one too), it is bounded only by MAX_ARG_STRLEN (128 KiB, far above
this), and JSON can be read in `ps` before the title is set and typed by hand:

    python -m tgw.workers '{"worker_id": 0, "identity": "w0.0", "segment": "...", ...}'

Broker and worker are one installation, so an unknown field is an error, not something to skip.
"""
from __future__ import annotations

from typing import Any, Literal, Optional

import msgspec


class WorkerStart(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    worker_id: int
    identity: str                   # its socket identity, "w<id>.<generation>"
    segment: str                    # the ring the supervisor created for this life
    input_bytes: int                # the ring's input arena, then its output arena
    output_bytes: int
    endpoint: str                   # the broker's worker-facing address
    device: str = "cpu"
    threads: int = 1                # torch intra-op threads (workers.threads_per_worker)
    cpus: list[int] = []            # cores to pin to (workers.pin_cpus); [] leaves affinity alone
    heartbeat_s: float = 1.0        # supervisor.heartbeat_s
    # modules, .py files or .so libraries loaded before any model (workers.preload)
    preload: list[str] = []
    # how a CUDA worker page-locks its ring (workers.cuda_host_memory; workers/device_io.py)
    host_memory: Literal["register", "staging", "pageable"] = "register"
    log_format: Literal["text", "json"] = "text"   # the broker's --log-format: the worker logs the same way
    slow_ms: Optional[float] = None                # observability.slow_request_ms: slow batches are logged
    tracing: Optional[dict[str, Any]] = None       # observability.tracing, resolved (paths absolute), as a dict
    gc_freeze: bool = False                        # server.gc_freeze: gc.freeze() once the start-up models are warm


class BadStart(ValueError):
    """The start-up argument is not a WorkerStart."""


def encode_start(start: WorkerStart) -> str:
    return msgspec.json.encode(start).decode()


_decoder = msgspec.json.Decoder(WorkerStart)


def decode_start(arg: str) -> WorkerStart:
    """The WorkerStart in `arg`; BadStart naming what is wrong (msgspec names the field)."""
    try:
        return _decoder.decode(arg)
    except msgspec.DecodeError as exc:
        raise BadStart(f"bad start-up argument: {exc}") from None
