"""The worker's output arena: a batch's outputs written into blocks of it, whole or in parts.

The worker is the arena's one writer; the broker frees a block by listing it on its next batch
(or in a Release message when none is coming). Outputs that can never fit as one block are
answered in parts at request boundaries, each part sent as soon as it is written, so the broker
answers it and frees its block while later parts wait for space. From a CUDA worker the bytes
are copied off the device on the batch's slot stream (device_io.py). A stage's `bytes` output
(stage_outputs.PackedBytes) is written as packed, its rows' offsets in BlockTensor.cuts; the
requests a stage failed (Done.failed) go with the part that holds them.
"""
from __future__ import annotations

import itertools
import logging
import time
from typing import Callable

import torch

from tgw.shm.errors import Code
from tgw.shm.ring import BlockTooLarge, RingAllocator, aligned_total, region_offsets
from tgw.shm.wire import Batch, BlockTensor, Done, ErrorBody, Release

from .answers import error_done
from .device_io import DeviceIO, Slot
from .mailbox import Mailbox
from .runner import ModelRunner
from .stage_outputs import PackedBytes

log = logging.getLogger("tgw.worker")
RELEASE_WAIT_S = 30.0  # how long a batch may wait for output space before failing OUT_OF_SHM


class OutputSpaceTimeout(RuntimeError):
    """The output arena stayed too full for a block for RELEASE_WAIT_S."""


def _nbytes(t) -> int:
    return t.nbytes if isinstance(t, PackedBytes) else t.numel() * t.element_size()


def _of_part(failed: dict[int, ErrorBody], lo: int, hi: int) -> dict[int, ErrorBody]:
    return {k: v for k, v in failed.items() if lo <= k < hi}


def request_starts(batch: Batch) -> list[int]:
    """Where each request's rows begin in the batch, and the end."""
    splits = batch.splits if sum(batch.splits) == batch.rows else [batch.rows]
    return list(itertools.accumulate(splits, initial=0))


class OutputBlocks:
    def __init__(self, buf, base: int, nbytes: int, mail: Mailbox, io: DeviceIO | None,
                 make_room: Callable[[], None]):
        self.buf, self.base, self.mail, self.io = buf, base, mail, io
        self.allocator = RingAllocator(nbytes)
        self.make_room = make_room   # answers the batches launched before: their blocks come back once answered

    def release(self, msg: Batch | Release) -> None:
        """Free the blocks a Batch or a Release lists."""
        blocks = msg.release if isinstance(msg, Batch) else msg.blocks
        for block in blocks:
            try:
                self.allocator.release(block)
            except KeyError:  # a broker bug (a block released twice, or never lent) must not stop serving
                log.warning("release of output block %d ignored: it is not allocated", block)
        blocks.clear()  # a batch parked in the mailbox must not release twice

    def answer(self, batch: Batch, outs: list[torch.Tensor], runner: ModelRunner,
               skip: frozenset[int] = frozenset(), slot: Slot | None = None,
               failed: dict[int, ErrorBody] | None = None) -> Done:
        """The batch's completion with `outs` in one block; in parts when they can never fit as
        one (parts but the last sent here); OUT_OF_SHM when no space came in time. `failed`:
        the requests a stage failed, by index in the batch."""
        try:
            block, tensors = self.write(outs, runner, skip, slot)
        except BlockTooLarge:
            return self.write_parts(batch, outs, runner, skip, slot, failed=failed)
        except OutputSpaceTimeout as exc:
            return error_done(batch, Code.OUT_OF_SHM, str(exc), arena="output")
        return Done(batch_id=batch.batch_id, outputs=tensors, block=block, failed=failed or {})

    def emit(self, done: Done, slot: Slot | None) -> Done | None:
        """The final part is returned (sent with the batch's completion); any other is sent now,
        once its bytes are in the ring, so the broker answers and frees its block meanwhile."""
        if done.final:
            return done
        if slot is not None:
            self.io.settle(slot)
        self.mail.send(done)
        return None

    def write_parts(self, batch: Batch, outs: list[torch.Tensor], runner: ModelRunner,
                    skip: frozenset[int] = frozenset(), slot: Slot | None = None,
                    lo: int = 0, hi: int | None = None, failed: dict[int, ErrorBody] | None = None) -> Done | None:
        """Write the outputs of requests lo..hi-1 (`outs` holds their rows) in parts at request
        boundaries, packed greedily so each part fits the arena, each sent once written. The
        batch's final part is returned instead (None when these requests end before it). A
        request whose outputs alone can never fit is answered OUT_OF_SHM; the others get theirs."""
        starts = request_starts(batch)
        n = len(starts) - 1
        hi = n if hi is None else hi
        rows = starts[hi] - starts[lo]
        row_bytes = [0 if k in skip or isinstance(t, PackedBytes) else _nbytes(t) // max(rows, 1)
                     for k, t in enumerate(outs)]
        cap, i = self.allocator.capacity, lo

        def need(a: int, b: int) -> int:  # one block holding the outputs of requests a..b-1
            return aligned_total([t.span(starts[a] - starts[lo], starts[b] - starts[lo]) if isinstance(t, PackedBytes)
                                  else (starts[b] - starts[a]) * size for t, size in zip(outs, row_bytes)])

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
                    block, tensors = self.write([t[rel] for t in outs], runner, skip, slot)
                    done = Done(batch_id=batch.batch_id, outputs=tensors, block=block,
                                failed=_of_part(failed or {}, i, j))
                except OutputSpaceTimeout as exc:  # the rest of these requests fail with it
                    done, j = error_done(batch, Code.OUT_OF_SHM, str(exc), arena="output"), hi
            done.first, done.count, done.final = i, j - i, j == n
            if self.emit(done, slot) is not None:
                return done
            i = j
        return None

    def write(self, outs: list[torch.Tensor], runner: ModelRunner, skip: frozenset[int] = frozenset(),
              slot: Slot | None = None) -> tuple[int, list[BlockTensor]]:
        """One output block holding `outs`, but those at `skip` (written into callers' CUDA buffers:
        described with their shape, no bytes). From a device: copies queued on the slot's stream."""
        sizes = [0 if k in skip else _nbytes(t) for k, t in enumerate(outs)]
        block = self._alloc(aligned_total(sizes))
        if slot is not None:
            self.io.outputs(slot, outs, self.base + block, sizes)
        tensors = []
        for decl, t, size, rel in zip(runner.outputs, outs, sizes, region_offsets(sizes)):
            offset = self.base + block + rel
            if isinstance(t, PackedBytes):   # a stage's bytes output (stages run with no slot)
                self.buf[offset:offset + size] = t.data
                tensors.append(BlockTensor(name=decl.name, dtype=decl.dtype, shape=list(t.shape), offset=offset,
                                           nbytes=size, cuts=list(t.cuts)))
                continue
            if size and slot is None:
                dst = torch.frombuffer(self.buf, dtype=t.dtype, count=t.numel(), offset=offset)
                dst.copy_(t.reshape(-1))
                del dst
            tensors.append(BlockTensor(name=decl.name, dtype=decl.dtype, shape=list(t.shape),
                                       offset=offset, nbytes=size))
        return block, tensors

    def _alloc(self, nbytes: int) -> int:
        """A block; while the arena is full, answer the batches launched before and apply the
        releases of the messages read meanwhile (parked for the loop, but for bare Releases)."""
        block = self.allocator.alloc(nbytes)
        if block is None:
            self.make_room()
        deadline = time.monotonic() + RELEASE_WAIT_S
        while block is None:
            if not self.mail.arrived(max(1, int((deadline - time.monotonic()) * 1000))):
                raise OutputSpaceTimeout(f"output arena full for {RELEASE_WAIT_S:.0f}s ({nbytes} bytes wanted)")
            msg = self.mail.read()
            if isinstance(msg, (Batch, Release)):   # the messages that carry releases
                self.release(msg)
                block = self.allocator.alloc(nbytes)
            if not isinstance(msg, Release):
                self.mail.park(msg)
        return block
