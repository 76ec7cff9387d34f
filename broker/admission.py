"""Admission: the checks a request passes before it may wait in a queue.

Validate against the model's declaration, size it, inflate compressed tensors (never past
their declared size), give it a deadline and queue it. Every refusal is a TgwError raised
here; the caller answers it. Rate limits, concurrency windows and the circuit breaker of
the scheduler belong here too, in front of the queue.
"""
from __future__ import annotations

import time
from typing import Callable

import lz4.frame

from tgw.shm.errors import Code, fail
from tgw.shm.ring import aligned_total
from tgw.shm.wire import Infer, TensorMeta, nbytes_of

from .batcher import Batcher, Pending
from .callers import Callers
from .config import Config
from .limits import check_declared
from .registry import Registry
from .stats import Stats


class Admission:
    def __init__(self, cfg: Config, registry: Registry, batcher: Batcher, stats: Stats, callers: Callers,
                 clock: Callable[[], float] = time.monotonic, unavailable: Callable[[], str] = str):
        self.registry, self.batcher, self.stats, self.clock = registry, batcher, stats, clock
        self.callers, self.server = callers, cfg.server
        self.unavailable = unavailable  # why no worker may serve now ("" while one may)
        self.max_request = cfg.server.max_request_bytes
        self.arena = cfg.workers.input_bytes  # a request that alone overflows it could never be staged
        self.out_arena = cfg.workers.output_bytes  # nor one whose outputs alone overflow this
        self.open = True

    def admit(self, client: bytes, msg: Infer, tensor_frames: list) -> Pending:
        """Queue the request (or raise the TgwError that answers it)."""
        if not self.open:
            raise fail(Code.MODEL_NOT_READY, "broker is shutting down", reason="shutting_down")
        self.callers.check_owed(client)
        check_declared(msg, self.server)
        sizes = [len(f) for f in tensor_frames]
        if sum(sizes) > self.max_request:  # compressed frames of incompressible data can outgrow the raw bytes
            raise fail(Code.PAYLOAD_TOO_LARGE, f"request carries {sum(sizes)} bytes of tensors; the limit is "
                       f"{self.max_request} (server.max_request_bytes)", limit=self.max_request)
        checked = self.registry.validate(msg, sizes)
        why = self.unavailable()
        if why:
            raise fail(Code.MODEL_NOT_READY, why, reason="crash_loop", model=msg.model)
        tensors = [inflate(msg.inputs[i], tensor_frames[i].buffer) for i in checked.order]
        need = aligned_total([len(t) for t in tensors])
        if need > self.arena:
            raise fail(Code.PAYLOAD_TOO_LARGE, f"request needs {need} bytes of shared memory; a worker's input "
                       f"arena holds {self.arena} (workers.input_arena_mb)", limit=self.arena)
        out_nbytes = checked.model.output_bytes(checked.rows)  # None: sized only after compute
        out_need = aligned_total(out_nbytes or [])
        if out_need > self.out_arena:  # never computed: its outputs could never be written
            raise fail(Code.OUT_OF_SHM, f"request's outputs need {out_need} bytes of shared memory; a worker's "
                       f"output arena holds {self.out_arena} (workers.output_arena_mb)", model=msg.model,
                       needed=out_need, limit=self.out_arena, arena="output", config_key="workers.output_arena_mb",
                       retryable=False)
        model = checked.model.decl
        timeout_ms = msg.timeout_ms if msg.timeout_ms is not None else model.timeout_ms
        p = Pending(client=client, req_id=msg.id, model=model.name, version=checked.version, rows=checked.rows,
                    shape_key=checked.shape_key, tensors=tensors, outputs=checked.outputs,
                    deadline=self.clock() + timeout_ms / 1000.0, compress=msg.compress_outputs,
                    out_nbytes=out_nbytes)
        self.batcher.push(p)
        self.callers.owe(client)
        self.stats.models[model.name].requests += 1
        return p


def inflate(meta: TensorMeta, buf: memoryview) -> memoryview:
    """A tensor's raw bytes: the frame itself, or its lz4 frame inflated to exactly the declared size."""
    if meta.compression is None:
        return buf
    want = nbytes_of(meta.dtype, meta.shape)
    inflater = lz4.frame.LZ4FrameDecompressor()
    try:  # never inflate past the declared size: a small frame must not cost gigabytes
        raw = inflater.decompress(buf, max_length=want)
    except RuntimeError as exc:
        raise fail(Code.INVALID_ARGUMENT, f"input {meta.name!r}: bad lz4 frame: {exc}", input=meta.name) from None
    if len(raw) != want or not inflater.eof:
        raise fail(Code.INVALID_ARGUMENT, f"input {meta.name!r}: lz4 frame does not decompress to the "
                   f"{want} bytes that shape {meta.shape} x {meta.dtype} needs", input=meta.name)
    return memoryview(raw)
