"""The worker's serving loop: batches in, outputs written to its output arena, completions out.

The worker reads the input arena in place (torch.frombuffer views, no copy) and is the one
writer of the output arena (output_blocks.py); the broker frees output blocks by listing them
on its next batch (or in a Release message when none is coming).

A CUDA worker copies each batch's block to its GPU and its outputs back (device_io.py) on a
stream per batch in flight, and launches a batch that is waiting before it waits for the one
before, so one's copies overlap the other's compute; completions go out in order, each once
its batch's CUDA event has completed (so the broker frees its input block only then). A batch
that runs out of GPU memory is run again in halves (oom.py). A stage's batch (a StageRunner's)
and a sequence model's (a SequenceRunner's: its Batch.steps fed to it) go to stage_serve.py.

Withdrawn requests (the broker's Withdraw, read by the mailbox) are taken out of a batch as it
launches: the rest run as a smaller batch (withdrawn.py), on the CPU, a GPU and a stage alike.
A batch with CUDA tensors by IPC handle is run whole instead (its callers' buffers are opened per
request; the broker drops the answers of the withdrawn ones), as is a batch already launched.
A sticky CUDA error ends the loop unanswered (cuda_faults.py).

A generator's batch (a GeneratorRunner's) is taken in as sequences and answered at once; while
any generator has sequences the loop reads only what is waiting and runs one iteration of each
between messages (generate/serving.py), blocking on the socket only when none has work.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from contextlib import nullcontext

import torch
import zmq

from tgw.shm.doorbell import Lane
from tgw.shm.errors import Code
from tgw.shm.segment import Segment
from tgw.shm.wire import Batch, BlockTensor, CancelSequences, Done, Release, Stop, WorkerFault, model_key

from . import cuda_ipc
from .answers import error_done, failed
from .cuda_faults import fault_of
from .device_identity import device_uuid
from .device_io import MAX_SLOTS, DeviceIO, Slot
from .failure_log import FailureLog
from .generate.runner import GeneratorRunner
from .generate.serving import Generation
from .mailbox import Mailbox
from .oom import halves, is_oom, oom_text
from .output_blocks import OutputBlocks, request_starts
from .progress import Progress
from .runner import TORCH_DTYPES, ModelRunner
from .sequence_runner import SequenceRunner
from .stage_runner import StageRunner
from .stage_serve import serve_stage
from .tracing import Observer
from .withdrawn import Shrunk, shrink

log = logging.getLogger("tgw.worker")
SPIN_S = 50e-6         # between looks at a launched batch's CUDA event and at the socket


class Launched:
    """A batch whose work is queued (on its device, when a CUDA worker), until it is answered."""
    __slots__ = ("batch", "t0", "start_ns", "done", "slot", "shrunk")

    def __init__(self, batch: Batch, start_ns: int):
        self.batch, self.t0, self.start_ns = batch, time.perf_counter(), start_ns
        self.done: Done | None = None
        self.slot: Slot | None = None     # its stream and buffers, until its work is done
        self.shrunk: Shrunk | None = None  # requests were withdrawn from it before launch


class Server:
    def __init__(self, sock: Lane | zmq.Socket, segment: Segment, input_bytes: int, output_bytes: int,
                 runners: dict[str, ModelRunner], progress: Progress | None = None, observer: Observer | None = None,
                 device: torch.device = torch.device("cpu"), host_memory: str = "register",
                 overlap: bool | None = None, worker_id: int = 0):
        self.sock, self.segment, self.runners, self.worker_id = sock, segment, runners, worker_id
        self.observer = observer        # spans and slow batch lines (workers/tracing.py), or None
        self.failures = FailureLog()    # a WARNING line per failed batch, always (failure_log.py)
        self.progress = progress or Progress()  # read by the beacon thread
        self.mail = Mailbox(sock)
        self.device = device
        self.device_uuid = device_uuid(device)   # CUDA IPC descriptors name the GPU they are of
        # registering the ring may fall back to staging (device_io.py): io.mode is what is in use
        self.io = DeviceIO(segment.buf, device, host_memory) if device.type == "cuda" else None
        self.blocks = OutputBlocks(segment.buf, input_bytes, output_bytes, self.mail, self.io, self._finish_all)
        self.progress.outputs = self.blocks.allocator   # the beacon reports its use
        # take a waiting batch before finishing the oldest: on a GPU its copy then overlaps the
        # other's compute; on the CPU nothing would overlap, and the oldest's answer would wait
        self.overlap = device.type == "cuda" if overlap is None else overlap
        self.launched: deque[Launched] = deque()
        self.running: Launched | None = None   # the batch being launched now
        self.serving = False
        self.generation = Generation(self)   # the generators' step loops (generate/serving.py)
        # the broker's messages to the loop, each type to its handler; any other is ignored
        self.handlers = {Batch: self._on_batch, Release: self.blocks.release, Stop: self._on_stop,
                         CancelSequences: self.generation.cancel}

    @property
    def host_memory(self) -> str:
        """The ring's page-locking in effect (register, staging or pageable), "" on a CPU worker."""
        return self.io.mode if self.io is not None else ""

    def serve(self) -> None:
        """Until Stop; after a sticky CUDA error, raises CudaFault once the broker is told."""
        self.serving = True
        try:
            while self.serving:
                if self.launched and self._finish_first():
                    self._finish()
                    continue
                if self.generation.due():   # answers first: a batch's Done before its sequences' Steps
                    self._finish_all()
                    self.generation.iterate()
                    continue
                msg = self.mail.next()
                self.generation.heard()
                handler = self.handlers.get(type(msg))
                if handler is not None:
                    handler(msg)
        except Exception as exc:
            # blamed: the batch launching, else the oldest launched (its event or copies were waited on)
            item = self.running or (self.launched[0] if self.launched else None)
            fault = fault_of(exc, item.batch.batch_id if item is not None else None)
            if fault is None:
                raise
            self.mail.send(WorkerFault(worker_id=self.worker_id, batch_id=fault.batch_id, error=fault.error,
                                       kind=fault.kind))
            self.io = None   # unregistering the ring on a broken context fails too: the exit unmaps it
            raise fault from None
        finally:
            self.close()

    def close(self) -> None:   # unregister a CUDA worker's ring, so the segment can be unmapped
        self.io is not None and self.io.close()

    def _on_batch(self, batch: Batch) -> None:
        self.blocks.release(batch)
        self.launched.append(self._start(batch))

    def _on_stop(self, _: Stop) -> None:
        self._finish_all()
        self.serving = False

    def _finish_first(self) -> bool:
        """Whether to finish the oldest launched batch now (its work is done, or nothing else is
        waiting) rather than take the message that is waiting."""
        if not self.overlap or len(self.launched) >= MAX_SLOTS:
            return True
        if self.mail.parked:
            return False
        slot = self.launched[0].slot
        while True:
            if self.mail.arrived():
                return False
            if slot is None or slot.event.query():
                return True
            time.sleep(SPIN_S)

    def _finish(self) -> None:
        item = self.launched.popleft()
        self._complete(item)
        self.mail.send(item.done)

    def _finish_all(self) -> None:
        while self.launched:
            self._finish()

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
        self.failures.batch(item.batch, done)
        if self.observer is not None:
            self.observer.batch(item.batch, done, item.start_ns, time.time_ns())

    def _withdraw(self, item: Launched) -> Batch:
        """The batch as it launches: without the requests withdrawn from it by now (those read
        already, and those waiting on the socket); the releases of what was read are applied."""
        batch = item.batch
        self.mail.look_ahead()
        for msg in self.mail.parked:   # their releases may be what this batch's outputs wait for
            if type(msg) in (Batch, Release):
                self.blocks.release(msg)
        gone = self.mail.launch(batch.batch_id)
        if not gone or batch.cuda_inputs or batch.cuda_outputs:
            return batch
        shrunk = shrink(batch, gone)
        if shrunk is None:
            return batch
        self.mail.report(batch.batch_id, shrunk.withdrawn)
        item.shrunk, item.batch = shrunk, shrunk.batch
        return shrunk.batch

    def kept_rows(self, x):
        """`x` (an input as the batch was sent) without the rows of requests withdrawn from the
        batch being launched."""
        shrunk = self.running.shrunk if self.running is not None else None
        return x if shrunk is None else shrunk.rows_of(x)

    def _run(self, item: Launched) -> Done:
        runner = self.runners.get(model_key(item.batch.model, item.batch.version))
        if isinstance(runner, GeneratorRunner):   # its requests become sequences of its step loop
            return self.generation.admit(item.batch, runner)
        batch = self._withdraw(item)
        if item.shrunk is not None and not batch.splits:   # every request withdrawn: nothing to compute
            return Done(batch_id=batch.batch_id)
        if batch.deadline and time.monotonic() > batch.deadline:
            return error_done(batch, Code.DEADLINE_EXCEEDED, "deadline passed while staged on the worker")
        key = model_key(batch.model, batch.version)
        runner = self.runners.get(key)
        if runner is None:
            return error_done(batch, Code.MODEL_NOT_READY, f"{key} is not loaded on this worker")
        if isinstance(runner, (StageRunner, SequenceRunner)):   # no device slot, steps to feed (stage_serve.py)
            return serve_stage(self, batch, runner)
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
                self.failures.note(batch.batch_id, exc)
                return failed(batch, exc)
            text = oom_text(exc)
        else:
            return self.blocks.answer(batch, outs, runner, slot=slot)
        # out of the except block: the exception's frames, which hold the inputs, are gone
        return self._in_halves(batch, runner, slot, text)

    def _inputs(self, batch: Batch, slot: Slot | None) -> list[torch.Tensor]:
        if slot is None:   # views of the ring, no copy (but a gather when requests were withdrawn)
            return [self.kept_rows(self.view(t)) for t in batch.inputs]
        # the batch's block in one copy to the device; each input a view of it there
        raw = self.io.inputs(slot, [t.offset for t in batch.inputs], [t.nbytes for t in batch.inputs])
        return [self.kept_rows(r.view(TORCH_DTYPES[t.dtype]).view(t.shape) if t.nbytes else
                               torch.empty(t.shape, dtype=TORCH_DTYPES[t.dtype], device=self.device))
                for r, t in zip(raw, batch.inputs)]

    def _in_halves(self, batch: Batch, runner: ModelRunner, slot: Slot | None, first: str) -> Done:
        """The batch met an out-of-memory (oom.py): again in halves at request boundaries, each
        piece answered as a part as soon as it is written."""
        starts = request_starts(batch)
        views = [self.kept_rows(self.view(t)) for t in batch.inputs]

        def compute(lo: int, hi: int) -> list[torch.Tensor]:
            outs = runner.forward([v[starts[lo]:starts[hi]] for v in views], starts[hi] - starts[lo])
            return [t.contiguous() for t in outs]

        return self.answer_in_halves(batch, runner, slot, compute, first)

    def answer_in_halves(self, batch: Batch, runner, slot: Slot | None, compute, first: str,
                         row_failures=dict) -> Done:
        """After an out-of-memory: `compute(lo, hi)` (the outputs of requests lo..hi-1) run in
        halves at request boundaries (oom.py), each piece answered as a part as soon as it is
        written; `row_failures()`: the requests a stage failed so far (Done.failed)."""
        self.met_oom(first)
        last = len(request_starts(batch)) - 1
        for lo, hi, result in halves(compute, 0, last, self.met_oom):
            if isinstance(result, BaseException):
                self.failures.note(batch.batch_id, result, getattr(runner, "code_file", ""))
                done = failed(batch, result)
                done.first, done.count, done.final = lo, hi - lo, hi == last
                if not done.final:   # the last part is logged as the batch completes
                    self.failures.batch(batch, done)
                done = self.blocks.emit(done, slot)
            else:
                done = self.blocks.write_parts(batch, result, runner, slot=slot, lo=lo, hi=hi, failed=row_failures())
            del result
            if done is not None:
                return done
        raise AssertionError("the pieces did not reach the batch's last request")

    def met_oom(self, text: str) -> None:
        self.progress.gpu_ooms += 1
        log.warning("out of GPU memory (%s); cache emptied, the batch split at request boundaries", text)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def view(self, t: BlockTensor) -> torch.Tensor:
        """An input of the batch as a view of the ring, no copy."""
        dtype = TORCH_DTYPES[t.dtype]
        if t.nbytes == 0:
            return torch.empty(t.shape, dtype=dtype)
        flat = torch.frombuffer(self.segment.buf, dtype=dtype, count=t.nbytes // dtype.itemsize, offset=t.offset)
        return flat.view(t.shape)
