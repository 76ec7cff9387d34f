"""The worker's serving loop: batches in, outputs written to its output arena, completions out.

The worker reads the input arena in place (torch.frombuffer views, no copy) and is the one
writer of the output arena; the broker frees output blocks by listing them on its next batch
(or in a Release message when none is coming).
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import deque

import torch
import zmq

from tgw.shm.errors import Code, TgwError, fail
from tgw.shm.ring import BlockTooLarge, RingAllocator, aligned_total, region_offsets
from tgw.shm.segment import Segment
from tgw.shm.wire import Batch, BlockTensor, Done, Release, Stop, encode, model_key, to_worker_decoder

from . import cuda_ipc
from .heartbeat import Progress
from .runner import TORCH_DTYPES, ModelRunner
from .tracing import Observer

log = logging.getLogger("tgw.worker")
RELEASE_WAIT_S = 30.0  # how long a batch may wait for output space before failing OUT_OF_SHM


class OutputSpaceTimeout(RuntimeError):
    pass


class Server:
    def __init__(self, sock: zmq.Socket, segment: Segment, input_bytes: int, output_bytes: int,
                 runners: dict[str, ModelRunner], progress: Progress | None = None, observer: Observer | None = None):
        self.sock, self.segment, self.runners = sock, segment, runners
        self.observer = observer        # spans and slow/failed batch lines (workers/tracing.py), or None
        self.progress = progress or Progress()  # read by the beacon thread
        self.output_base = input_bytes
        self.outputs = RingAllocator(output_bytes)
        self.progress.outputs = self.outputs   # the beacon reports its use
        self.inbox: deque = deque()   # messages read while waiting for output space

    def _next(self):
        if self.inbox:
            return self.inbox.popleft()
        return to_worker_decoder.decode(self.sock.recv())

    def serve(self) -> None:
        while True:
            msg = self._next()
            if isinstance(msg, Batch):
                self._apply_releases(msg)
                self.sock.send(encode(self.run_batch(msg)))
            elif isinstance(msg, Release):
                self._apply_releases(msg)
            elif isinstance(msg, Stop):
                return

    def _apply_releases(self, msg: Batch | Release) -> None:
        blocks = msg.release if isinstance(msg, Batch) else msg.blocks
        for block in blocks:
            try:
                self.outputs.release(block)
            except KeyError:  # a broker bug (a block released twice, or never lent) must not stop serving
                log.warning("release of output block %d ignored: it is not allocated", block)
        blocks.clear()  # a batch parked in the inbox must not release twice

    def run_batch(self, batch: Batch) -> Done:
        start = time.time_ns() if self.observer is not None else 0
        try:
            done = self._run(batch)
        finally:
            self.progress.end()
        if self.observer is not None:
            self.observer.batch(batch, done, start, time.time_ns())
        return done

    def _run(self, batch: Batch) -> Done:
        t0 = time.perf_counter()
        if batch.deadline and time.monotonic() > batch.deadline:
            return _error(batch, Code.DEADLINE_EXCEEDED, "deadline passed while staged on the worker")
        key = model_key(batch.model, batch.version)
        runner = self.runners.get(key)
        if runner is None:
            return _error(batch, Code.MODEL_NOT_READY, f"{key} is not loaded on this worker")
        self.progress.start(batch.batch_id)
        if batch.cuda_inputs or batch.cuda_outputs:   # CUDA tensors by IPC handle (cuda_ipc.py)
            return cuda_ipc.run(self, batch, runner, t0)
        try:
            inputs = [self._view(t) for t in batch.inputs]
            outs = runner.run(inputs, batch.rows)
            del inputs  # views pin the mapping; drop them before anything can close it
        except torch.cuda.OutOfMemoryError as exc:
            return _error(batch, Code.OUT_OF_GPU_MEMORY, str(exc).splitlines()[0])
        except TgwError as err:   # the requests' own fault (a dim outside the program's range)
            return Done(batch_id=batch.batch_id, error=err.to_body())
        except Exception as exc:  # a model bug fails this batch, not the worker
            return _error(batch, Code.MODEL_EXECUTION_ERROR, f"{type(exc).__name__}: {exc}".strip()[:2000],
                          exception=type(exc).__name__)
        try:
            block, tensors = self._write(outs, runner)
        except BlockTooLarge:  # can never fit as one block: answer it in parts
            done = self._write_parts(batch, outs, runner)
        except OutputSpaceTimeout as exc:
            return _error(batch, Code.OUT_OF_SHM, str(exc), arena="output")
        else:
            done = Done(batch_id=batch.batch_id, outputs=tensors, block=block)
        done.compute_us = int((time.perf_counter() - t0) * 1e6)
        return done

    def _write_parts(self, batch: Batch, outs: list[torch.Tensor], runner: ModelRunner,
                     skip: frozenset[int] = frozenset()) -> Done:
        """Write the outputs in parts at request boundaries, packed greedily so each part fits the
        arena, and send each part but the last (returned) as soon as it is written: the broker
        replies and releases its block while later parts wait for space. A request whose outputs
        alone can never fit is answered OUT_OF_SHM; the others get their outputs."""
        splits = batch.splits if sum(batch.splits) == batch.rows else [batch.rows]
        starts = list(itertools.accumulate(splits, initial=0))
        row_bytes = [0 if k in skip else t.numel() * t.element_size() // batch.rows for k, t in enumerate(outs)]
        cap, n, i = self.outputs.capacity, len(splits), 0

        def need(lo: int, hi: int) -> int:  # one block holding the outputs of requests lo..hi-1
            return aligned_total([(starts[hi] - starts[lo]) * size for size in row_bytes])

        while True:
            j = i + 1
            alone = need(i, j)
            if alone > cap:
                done = _error(batch, Code.OUT_OF_SHM, f"request's outputs need {alone} bytes of shared memory; "
                              f"a worker's output arena holds {cap} (workers.output_arena_mb)", arena="output",
                              needed=alone, limit=cap, config_key="workers.output_arena_mb", retryable=False)
            else:
                while j < n and need(i, j + 1) <= cap:
                    j += 1
                try:
                    block, tensors = self._write([t[starts[i]:starts[j]] for t in outs], runner, skip)
                    done = Done(batch_id=batch.batch_id, outputs=tensors, block=block)
                except OutputSpaceTimeout as exc:  # the rest of the batch fails with it
                    done, j = _error(batch, Code.OUT_OF_SHM, str(exc), arena="output"), n
            done.first, done.count, done.final = i, j - i, j == n
            if done.final:
                return done
            self.sock.send(encode(done))
            i = j

    def _view(self, t: BlockTensor) -> torch.Tensor:
        dtype = TORCH_DTYPES[t.dtype]
        if t.nbytes == 0:
            return torch.empty(t.shape, dtype=dtype)
        flat = torch.frombuffer(self.segment.buf, dtype=dtype, count=t.nbytes // dtype.itemsize, offset=t.offset)
        return flat.view(t.shape)

    def _write(self, outs: list[torch.Tensor], runner: ModelRunner, skip: frozenset[int] = frozenset()):
        """One output block holding `outs`, but those at `skip` (written into callers' CUDA buffers:
        described with their shape, no bytes)."""
        sizes = [0 if k in skip else t.numel() * t.element_size() for k, t in enumerate(outs)]
        block = self._alloc(aligned_total(sizes))
        tensors = []
        for decl, t, size, rel in zip(runner.outputs, outs, sizes, region_offsets(sizes)):
            offset = self.output_base + block + rel
            if size:
                dst = torch.frombuffer(self.segment.buf, dtype=t.dtype, count=t.numel(), offset=offset)
                dst.copy_(t.reshape(-1))
                del dst
            tensors.append(BlockTensor(name=decl.name, dtype=decl.dtype, shape=list(t.shape),
                                       offset=offset, nbytes=size))
        return block, tensors

    def _alloc(self, nbytes: int) -> int:
        """An output block; while the arena is full, apply the broker's pending releases."""
        block = self.outputs.alloc(nbytes)
        deadline = time.monotonic() + RELEASE_WAIT_S
        while block is None:
            if not self.sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                raise OutputSpaceTimeout(f"output arena full for {RELEASE_WAIT_S:.0f}s ({nbytes} bytes wanted)")
            msg = to_worker_decoder.decode(self.sock.recv())
            if isinstance(msg, (Batch, Release)):
                self._apply_releases(msg)
                block = self.outputs.alloc(nbytes)
            if not isinstance(msg, Release):
                self.inbox.append(msg)
        return block


def _error(batch: Batch, code: Code, message: str, **details) -> Done:
    return Done(batch_id=batch.batch_id, error=fail(code, message, **details).to_body())
