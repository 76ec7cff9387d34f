"""CUDA tensors by IPC handle, the worker's part (docs/PROTOCOL.md section 5.10).

A batch whose requests' inputs are CUDA tensors of a caller on this box carries their CudaIpc
descriptors (Batch.cuda_inputs) instead of ring bytes; a batch may also name callers' CUDA
buffers for outputs (Batch.cuda_outputs). This worker, on that GPU, opens each descriptor the
way torch.multiprocessing's rebuild_cuda_tensor does (torch/multiprocessing/reductions.py:
UntypedStorage._new_shared_cuda, then a tensor over that storage): the caller's memory read in
place, no copy. Opening waits, on this device's current stream, for the caller's event when the
descriptor says so (event_sync_required: inside _new_shared_cuda, StorageSharing.cpp), so the
model's kernels on that stream see the caller's data.

Handles are not cached past a batch. torch already maps each allocation once per process while
any storage over it lives (CUDACachingAllocator::getIpcDevPtr keeps a handle -> mapping table),
so several requests from one allocation in a batch share one cudaIpcOpenMemHandle. Holding
storages longer would keep the caller's ref-counted block out of its allocator (torch's "limbo")
after the caller dropped it, and a caller reuses its blocks all the time. So every storage
opened for a batch is dropped - its deleter syncs the stream and decrements the caller's
counter - before the batch's completion is sent: once a caller has its reply, nothing here
touches its memory again.

A descriptor that cannot be opened (a stale or foreign handle, another GPU, too small a
storage) fails its own request (INVALID_ARGUMENT); the batch's other requests run, with zeros
in the failed one's rows, and the answer comes in parts at request boundaries.
"""
from __future__ import annotations

import itertools
import time

import torch

from tgw.shm.devices import norm_uuid
from tgw.shm.errors import Code, TgwError, fail
from tgw.shm.ring import BlockTooLarge
from tgw.shm.wire import Batch, CudaIpc, Done

from .answers import error_done, failed
from .oom import is_oom
from .output_blocks import OutputSpaceTimeout
from .runner import TORCH_DTYPES


def _bad(message: str, reason: str = "cuda_bad_handle", **details) -> TgwError:
    return fail(Code.INVALID_ARGUMENT, message, reason=reason, **details)


def open_storage(d: CudaIpc, device: torch.device, own_uuid: str = "") -> torch.UntypedStorage:
    """The caller's storage `d` describes, mapped into this process on `device` (this worker's)."""
    if device.type != "cuda":
        raise _bad(f"a CUDA tensor of cuda:{d.device} reached a worker on {device}", "cuda_wrong_device")
    if d.device_uuid and own_uuid:
        if norm_uuid(d.device_uuid) != norm_uuid(own_uuid):
            raise _bad(f"a CUDA tensor of GPU {d.device_uuid} reached the worker on {device} ({own_uuid})",
                       "cuda_wrong_device")
    elif d.device != device.index:
        raise _bad(f"a CUDA tensor of cuda:{d.device} reached the worker on {device}", "cuda_wrong_device")
    if not d.handle or d.storage_bytes <= 0 or d.storage_offset_bytes < 0:
        raise _bad("a CUDA IPC descriptor without a handle, or with no storage")
    try:   # the argument list of rebuild_cuda_tensor's _new_shared_cuda call, on this worker's index
        return torch.UntypedStorage._new_shared_cuda(
            device.index, d.handle, d.storage_bytes, d.storage_offset_bytes, d.ref_counter_handle,
            d.ref_counter_offset, d.event_handle or bytes(64), bool(d.event_sync_required))
    except Exception as exc:
        first = (str(exc).splitlines() or [""])[0]
        raise _bad(f"cannot open the CUDA IPC handle: {type(exc).__name__}: {first}".strip()) from None


def over(storage: torch.UntypedStorage, dtype: torch.dtype, shape: list[int], offset_bytes: int,
         what: str) -> torch.Tensor:
    """A C-contiguous tensor of `shape` x `dtype` starting `offset_bytes` into `storage` (as
    torch._utils._rebuild_tensor builds one over a received storage); refused when it would
    reach past the storage or start unaligned."""
    item = dtype.itemsize
    need = item
    for dim in shape:
        need *= dim
    if offset_bytes < 0 or offset_bytes % item:
        raise _bad(f"{what}: offset {offset_bytes} is not a multiple of {item} ({dtype})", "cuda_bad_layout")
    if offset_bytes + need > storage.nbytes():
        raise _bad(f"{what}: {list(shape)} x {str(dtype).removeprefix('torch.')} needs {need} bytes from byte "
                   f"{offset_bytes}; the CUDA buffer holds {storage.nbytes()}", "cuda_buffer_too_small",
                   needed=need, size=storage.nbytes() - offset_bytes)
    stride, acc = [], 1
    for dim in reversed(shape):
        stride.append(acc)
        acc *= max(dim, 1)
    typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)
    return torch._utils._rebuild_tensor(typed, offset_bytes // item, tuple(shape), tuple(reversed(stride)))


def run(server, batch: Batch, runner, t0: float) -> Done:
    """Serve a batch carrying CUDA descriptors, once the serving loop (serve.Server) has checked
    its deadline and found its model's `runner`; `server` lends its progress, device_uuid, view()
    (an input in the ring) and blocks (the output arena). Every storage it opens is dropped
    before it returns, so before the completion is sent."""
    n = len(batch.cuda_inputs or batch.cuda_outputs)
    splits = batch.splits if len(batch.splits) == n and sum(batch.splits) == batch.rows else None
    if splits is None:
        return error_done(batch, Code.INTERNAL, f"batch has {n} requests' CUDA descriptors but splits {batch.splits}")
    starts = list(itertools.accumulate(splits, initial=0))
    bad: dict[int, TgwError] = {}
    try:
        host, skip = _compute(server, batch, runner, splits, starts, bad)
    except Exception as exc:  # a model bug or an out-of-memory fails this batch, not the worker
        if is_oom(exc):
            server.progress.gpu_ooms += 1
        return failed(batch, exc)
    done = _answer_requests(server.blocks, batch, runner, host, skip, bad, starts)
    done.compute_us = int((time.perf_counter() - t0) * 1e6)
    return done


def _compute(server, batch: Batch, runner, splits: list[int], starts: list[int], bad: dict):
    """Open, forward, write the callers' buffers; (the outputs for the arena, the indices of
    those every answered request took in its CUDA buffer). Opened storages die with this frame."""
    device, n = runner.device, len(splits)
    own = server.device_uuid
    opened: list[list[torch.Tensor]] = [[] for _ in range(n)]
    buffers: list[dict[str, tuple]] = [{} for _ in range(n)]
    for r in range(n):
        try:
            for d, t in zip(batch.cuda_inputs[r] if batch.cuda_inputs else (), batch.inputs):
                storage = open_storage(d, device, own)
                opened[r].append(over(storage, TORCH_DTYPES[t.dtype], [splits[r], *t.shape[1:]], d.offset_bytes,
                                      f"input {t.name!r}"))
            for name, d in (batch.cuda_outputs[r] if batch.cuda_outputs else {}).items():
                buffers[r][name] = (open_storage(d, device, own), d.offset_bytes)
        except TgwError as err:
            bad[r] = err
            opened[r], buffers[r] = [], {}
    if len(bad) == n:
        return None, frozenset()
    if batch.cuda_inputs:
        inputs = []
        for k, t in enumerate(batch.inputs):
            dtype = TORCH_DTYPES[t.dtype]
            parts = [torch.zeros([splits[r], *t.shape[1:]], dtype=dtype, device=device) if r in bad else opened[r][k]
                     for r in range(n)]
            inputs.append(parts[0] if n == 1 else torch.cat(parts))
    else:
        inputs = [server.view(t) for t in batch.inputs]
    del opened
    outs = runner.forward(inputs, batch.rows)
    del inputs
    names = [o.name for o in runner.outputs]
    wrote = False
    for r in range(n):
        for name, (storage, offset) in buffers[r].items() if r not in bad else ():
            src = outs[names.index(name)][starts[r]:starts[r + 1]]
            try:
                dst = over(storage, src.dtype, list(src.shape), offset, f"output {name!r}")
            except TgwError as err:
                bad[r] = err
                break
            dst.copy_(src)
            wrote = True
            del dst
    if wrote and device.type == "cuda":   # the callers' buffers hold their rows before any completion leaves
        torch.cuda.current_stream(device).synchronize()
    answered = [r for r in range(n) if r not in bad]
    skip = frozenset(k for k, name in enumerate(names) if answered and all(name in buffers[r] for r in answered))
    del buffers
    return runner.to_host(outs, skip), skip


def _answer_requests(blocks, batch: Batch, runner, host, skip: frozenset, bad: dict, starts: list[int]) -> Done:
    """The completion in `blocks` (output_blocks.OutputBlocks): whole when every request was
    served, else in parts at request boundaries, each failed request a part of its own; parts
    but the last are sent here."""
    n = len(starts) - 1
    if not bad:
        return blocks.answer(batch, host, runner, skip)
    i = 0
    while True:
        if i in bad:
            done, j = Done(batch_id=batch.batch_id, error=bad[i].to_body()), i + 1
        else:
            j = next((r for r in range(i, n) if r in bad), n)
            try:
                block, tensors = blocks.write([t[starts[i]:starts[j]] for t in host], runner, skip)
                done = Done(batch_id=batch.batch_id, outputs=tensors, block=block)
            except (BlockTooLarge, OutputSpaceTimeout) as exc:
                done = error_done(batch, Code.OUT_OF_SHM, f"{type(exc).__name__}: {exc}", arena="output")
        done.first, done.count, done.final = i, j - i, j == n
        if blocks.emit(done, None) is not None:
            return done
        i = j
