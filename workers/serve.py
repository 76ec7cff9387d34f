"""The worker's serving loop: batches in, outputs written to its output arena, completions out.

The worker reads the input arena in place (torch.frombuffer views, no copy) and is the one
writer of the output arena; the broker frees output blocks by listing them on its next batch
(or in a Release message when none is coming).

A CUDA worker copies each batch's block to its GPU and its outputs back (device_io.py) on a
stream per batch in flight, and launches a batch that is waiting before it waits for the one
before, so one's copies overlap the other's compute; completions go out in order, each once
its batch's CUDA event has completed (so the broker frees its input block only then). A batch
that runs out of GPU memory is run again in halves (oom.py).
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from contextlib import nullcontext

import torch
import zmq

from tgw.shm.errors import Code
from tgw.shm.ring import BlockTooLarge, RingAllocator, aligned_total, region_offsets
from tgw.shm.segment import Segment
from tgw.shm.wire import Batch, BlockTensor, Done, Release, Stop, encode, model_key, to_worker_decoder

from . import cuda_ipc
from .device_io import MAX_SLOTS, DeviceIO, Slot
from .heartbeat import Progress
from .answers import error_done, failed
from .oom import halves, is_oom, oom_text
from .runner import TORCH_DTYPES, ModelRunner
from .tracing import Observer

log = logging.getLogger("tgw.worker")
RELEASE_WAIT_S = 30.0  # how long a batch may wait for output space before failing OUT_OF_SHM
SPIN_S = 50e-6         # between looks at a launched batch's CUDA event and at the socket


class OutputSpaceTimeout(RuntimeError):
    pass


class Launched:
    """A batch whose work is queued (on its device, when a CUDA worker); its completion is sent
    once that work is done."""
    __slots__ = ("batch", "t0", "start_ns", "done", "slot")

    def __init__(self, batch: Batch, start_ns: int):
        self.batch, self.t0, self.start_ns = batch, time.perf_counter(), start_ns
        self.done: Done | None = None
        self.slot: Slot | None = None     # its stream and buffers, until its work is done


class Server:
    def __init__(self, sock: zmq.Socket, segment: Segment, input_bytes: int, output_bytes: int,
                 runners: dict[str, ModelRunner], progress: Progress | None = None, observer: Observer | None = None,
                 device: torch.device = torch.device("cpu"), host_memory: str = "register",
                 overlap: bool | None = None):
        self.sock, self.segment, self.runners = sock, segment, runners
        self.observer = observer        # spans and slow/failed batch lines (workers/tracing.py), or None
        self.progress = progress or Progress()  # read by the beacon thread
        self.output_base = input_bytes
        self.outputs = RingAllocator(output_bytes)
        self.progress.outputs = self.outputs   # the beacon reports its use
        self.inbox: deque = deque()   # messages read while waiting for output space
        self.device = device
        self.io = DeviceIO(segment.buf, device, host_memory) if device.type == "cuda" else None
        # take a waiting batch before finishing the oldest: on a GPU its copy then overlaps the
        # other's compute; on the CPU nothing would overlap, and the oldest's answer would wait
        self.overlap = device.type == "cuda" if overlap is None else overlap
        self.launched: deque[Launched] = deque()
        self.running: Launched | None = None   # the batch being launched now

    def _next(self):
        if self.inbox:
            return self.inbox.popleft()
        return to_worker_decoder.decode(self.sock.recv())

    def serve(self) -> None:
        try:
            while True:
                if self.launched and self._finish_first():
                    self._finish()
                    continue
                msg = self._next()
                if isinstance(msg, Batch):
                    self._apply_releases(msg)
                    self.launched.append(self._start(msg))
                elif isinstance(msg, Release):
                    self._apply_releases(msg)
                elif isinstance(msg, Stop):
                    self._finish_all()
                    return
        finally:
            if self.io is not None:
                self.io.close()

    def _finish_first(self) -> bool:
        """Whether to finish the oldest launched batch now (its work is done, or nothing else is
        waiting) rather than take the message that is waiting."""
        if not self.overlap or len(self.launched) >= MAX_SLOTS:
            return True
        if self.inbox:
            return False
        slot = self.launched[0].slot
        while True:
            if self.sock.poll(0):
                return False
            if slot is None or slot.event.query():
                return True
            time.sleep(SPIN_S)

    def _finish(self) -> None:
        item = self.launched.popleft()
        self._complete(item)
        self.sock.send(encode(item.done))

    def _finish_all(self) -> None:
        while self.launched:
            self._finish()

    def _apply_releases(self, msg: Batch | Release) -> None:
        blocks = msg.release if isinstance(msg, Batch) else msg.blocks
        for block in blocks:
            try:
                self.outputs.release(block)
            except KeyError:  # a broker bug (a block released twice, or never lent) must not stop serving
                log.warning("release of output block %d ignored: it is not allocated", block)
        blocks.clear()  # a batch parked in the inbox must not release twice

    def run_batch(self, batch: Batch) -> Done:
        """One batch to its completion (its device work done); parts but the last are sent."""
        item = self._start(batch)
        self._complete(item)
        return item.done

    def _start(self, batch: Batch) -> Launched:
        item = Launched(batch, time.time_ns() if self.observer is not None else 0)
        if not self.launched:
            self.progress.start(batch.batch_id)
        self.running = item
        try:
            item.done = self._run(item)
        except BaseException:
            self.progress.end()
            raise
        finally:
            self.running = None
        return item

    def _complete(self, item: Launched) -> None:
        if item.slot is not None:
            self.io.wait(item.slot)
        done = item.done
        if done.error is None:
            done.compute_us = int((time.perf_counter() - item.t0) * 1e6)
        self.progress.end()
        oldest = self.launched[0] if self.launched else self.running   # what the beacon watches next
        if oldest is not None:
            self.progress.start(oldest.batch.batch_id)
        if self.observer is not None:
            self.observer.batch(item.batch, done, item.start_ns, time.time_ns())

    def _run(self, item: Launched) -> Done:
        batch = item.batch
        if batch.deadline and time.monotonic() > batch.deadline:
            return error_done(batch, Code.DEADLINE_EXCEEDED, "deadline passed while staged on the worker")
        key = model_key(batch.model, batch.version)
        runner = self.runners.get(key)
        if runner is None:
            return error_done(batch, Code.MODEL_NOT_READY, f"{key} is not loaded on this worker")
        if batch.cuda_inputs or batch.cuda_outputs:   # CUDA tensors by IPC handle (cuda_ipc.py)
            return cuda_ipc.run(self, batch, runner, item.t0)
        slot = item.slot = self.io.slot() if self.io is not None else None
        # the batch's CUDA work (copies and the model's kernels) on its slot's stream
        with torch.cuda.stream(slot.stream) if slot is not None else nullcontext():
            try:
                return self._forward(batch, runner, slot)
            finally:
                if slot is not None:
                    self.io.record(slot)

    def _forward(self, batch: Batch, runner: ModelRunner, slot: Slot | None) -> Done:
        try:
            outs = runner.forward(self._inputs(batch, slot), batch.rows)
            if slot is not None:   # here, where an out-of-memory is handled, not while answering
                outs = [t.contiguous() for t in outs]
        except Exception as exc:
            if not is_oom(exc):
                return failed(batch, exc)
            text = oom_text(exc)
        else:
            return self._answer(batch, outs, runner, slot)
        # out of the except block: the exception's frames, which hold the inputs, are gone
        return self._in_halves(batch, runner, slot, text)

    def _inputs(self, batch: Batch, slot: Slot | None) -> list[torch.Tensor]:
        if slot is None:   # views of the ring, no copy
            return [self._view(t) for t in batch.inputs]
        # the batch's block in one copy to the device; each input a view of it there
        raw = self.io.inputs(slot, [t.offset for t in batch.inputs], [t.nbytes for t in batch.inputs])
        return [r.view(TORCH_DTYPES[t.dtype]).view(t.shape) if t.nbytes else
                torch.empty(t.shape, dtype=TORCH_DTYPES[t.dtype], device=self.device)
                for r, t in zip(raw, batch.inputs)]

    def _answer(self, batch: Batch, outs: list[torch.Tensor], runner: ModelRunner, slot: Slot | None) -> Done:
        try:
            block, tensors = self._write(outs, runner, slot=slot)
        except BlockTooLarge:  # can never fit as one block: answer it in parts
            return self._write_parts(batch, outs, runner, slot=slot)
        except OutputSpaceTimeout as exc:
            return error_done(batch, Code.OUT_OF_SHM, str(exc), arena="output")
        return Done(batch_id=batch.batch_id, outputs=tensors, block=block)

    def _in_halves(self, batch: Batch, runner: ModelRunner, slot: Slot | None, first: str) -> Done:
        """The batch met an out-of-memory (oom.py): again in halves at request boundaries, each
        piece answered as a part as soon as it is written."""
        starts = _starts(batch)
        views = [self._view(t) for t in batch.inputs]

        def compute(lo: int, hi: int) -> list[torch.Tensor]:
            outs = runner.forward([v[starts[lo]:starts[hi]] for v in views], starts[hi] - starts[lo])
            return [t.contiguous() for t in outs]

        self._met_oom(first)
        for lo, hi, result in halves(compute, 0, len(starts) - 1, self._met_oom):
            if isinstance(result, BaseException):
                done = failed(batch, result)
                done.first, done.count, done.final = lo, hi - lo, hi == len(starts) - 1
                done = self._emit(done, slot)
            else:
                done = self._write_parts(batch, result, runner, slot=slot, lo=lo, hi=hi)
            del result
            if done is not None:
                return done
        raise AssertionError("the pieces did not reach the batch's last request")

    def _met_oom(self, text: str) -> None:
        self.progress.gpu_ooms += 1
        log.warning("out of GPU memory (%s); cache emptied, the batch split at request boundaries", text)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _emit(self, done: Done, slot: Slot | None) -> Done | None:
        """The final part is returned (sent with the batch's completion); any other is sent now,
        once its bytes are in the ring, so the broker answers and frees its block meanwhile."""
        if done.final:
            return done
        if slot is not None:
            self.io.settle(slot)
        self.sock.send(encode(done))
        return None

    def _write_parts(self, batch: Batch, outs: list[torch.Tensor], runner: ModelRunner,
                     skip: frozenset[int] = frozenset(), slot: Slot | None = None,
                     lo: int = 0, hi: int | None = None) -> Done | None:
        """Write the outputs of requests lo..hi-1 (`outs` holds their rows) in parts at request
        boundaries, packed greedily so each part fits the arena, and send each part as soon as it
        is written: the broker replies and releases its block while later parts wait for space.
        The batch's final part is returned instead (None when these requests end before it). A
        request whose outputs alone can never fit is answered OUT_OF_SHM; the others get theirs."""
        starts = _starts(batch)
        n = len(starts) - 1
        hi = n if hi is None else hi
        rows = starts[hi] - starts[lo]
        row_bytes = [0 if k in skip else t.numel() * t.element_size() // max(rows, 1) for k, t in enumerate(outs)]
        cap, i = self.outputs.capacity, lo

        def need(a: int, b: int) -> int:  # one block holding the outputs of requests a..b-1
            return aligned_total([(starts[b] - starts[a]) * size for size in row_bytes])

        while i < hi:
            j = i + 1
            alone = need(i, j)
            if alone > cap:
                done = error_done(batch, Code.OUT_OF_SHM, f"request's outputs need {alone} bytes of shared memory; "
                              f"a worker's output arena holds {cap} (workers.output_arena_mb)", arena="output",
                              needed=alone, limit=cap, config_key="workers.output_arena_mb", retryable=False)
            else:
                while j < hi and need(i, j + 1) <= cap:
                    j += 1
                try:
                    rel = slice(starts[i] - starts[lo], starts[j] - starts[lo])
                    block, tensors = self._write([t[rel] for t in outs], runner, skip, slot)
                    done = Done(batch_id=batch.batch_id, outputs=tensors, block=block)
                except OutputSpaceTimeout as exc:  # the rest of these requests fail with it
                    done, j = error_done(batch, Code.OUT_OF_SHM, str(exc), arena="output"), hi
            done.first, done.count, done.final = i, j - i, j == n
            if self._emit(done, slot) is not None:
                return done
            i = j
        return None

    def _view(self, t: BlockTensor) -> torch.Tensor:
        dtype = TORCH_DTYPES[t.dtype]
        if t.nbytes == 0:
            return torch.empty(t.shape, dtype=dtype)
        flat = torch.frombuffer(self.segment.buf, dtype=dtype, count=t.nbytes // dtype.itemsize, offset=t.offset)
        return flat.view(t.shape)

    def _write(self, outs: list[torch.Tensor], runner: ModelRunner, skip: frozenset[int] = frozenset(),
               slot: Slot | None = None):
        """One output block holding `outs`, but those at `skip` (written into callers' CUDA buffers:
        described with their shape, no bytes). From a device: copies queued on the slot's stream."""
        sizes = [0 if k in skip else t.numel() * t.element_size() for k, t in enumerate(outs)]
        block = self._alloc(aligned_total(sizes))
        if slot is not None:
            self.io.outputs(slot, outs, self.output_base + block, sizes)
        tensors = []
        for decl, t, size, rel in zip(runner.outputs, outs, sizes, region_offsets(sizes)):
            offset = self.output_base + block + rel
            if size and slot is None:
                dst = torch.frombuffer(self.segment.buf, dtype=t.dtype, count=t.numel(), offset=offset)
                dst.copy_(t.reshape(-1))
                del dst
            tensors.append(BlockTensor(name=decl.name, dtype=decl.dtype, shape=list(t.shape),
                                       offset=offset, nbytes=size))
        return block, tensors

    def _alloc(self, nbytes: int) -> int:
        """An output block; while the arena is full, answer the batches launched before (their
        blocks are released once answered) and apply the broker's pending releases."""
        block = self.outputs.alloc(nbytes)
        if block is None and self.launched:
            self._finish_all()
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


def _starts(batch: Batch) -> list[int]:
    """Where each request's rows begin in the batch, and the end."""
    splits = batch.splits if sum(batch.splits) == batch.rows else [batch.rows]
    return list(itertools.accumulate(splits, initial=0))
