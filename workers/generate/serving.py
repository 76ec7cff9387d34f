"""Generation inside the worker's serving loop (serve.Server): a generator's admission batch
taken in and answered at once, the broker's cancels, and one iteration of each generator with
work between the loop's other messages (docs/GENERATION.md "The step loop").

The serving loop blocks on its socket only while no generator has work; otherwise it reads what
is already waiting (batches of other models run as they come, interleaved), then runs one
iteration of each busy generator, each sending its own Steps. A generator's loop exists while it
holds sequences (its `freed` count is kept across); a generator unloaded under live sequences
ends them (MODEL_NOT_READY) at the next iteration.
"""
from __future__ import annotations

import math
import time

from tgw.shm.bytes_tensor import BYTES, BytesTensorError, unpack
from tgw.shm.errors import Code
from tgw.shm.wire import Batch, BlockTensor, CancelSequences, Done

from ..answers import error_done
from ..output_blocks import request_starts
from ..stage_serve import _nested
from .intake import Refused, sequence
from .loop import StepLoop
from .runner import GeneratorRunner

MESSAGES_PER_STEP = 32   # messages read at most between two iterations while generators have work


class Generation:
    def __init__(self, server):
        self.server = server
        self.loops: dict[str, StepLoop] = {}
        self.freed: dict[str, int] = {}   # key -> slots freed by cancellation since the worker started
        self.read = 0                     # messages read since the last iteration

    @property
    def busy(self) -> bool:
        return any(loop.busy for loop in self.loops.values())

    def due(self) -> bool:
        """Whether to run an iteration now rather than read the socket: work is waiting, and no
        message is (or enough were read since the last iteration)."""
        if not self.busy:
            return False
        mail = self.server.mail
        return self.read >= MESSAGES_PER_STEP or not (mail.parked or mail.arrived())

    def heard(self) -> None:
        """The serving loop read a message."""
        self.read += 1

    def loop_of(self, runner: GeneratorRunner) -> StepLoop:
        loop = self.loops.get(runner.key)
        if loop is None or loop.runner is not runner:
            if loop is not None:   # a runner replaced under live sequences: they end
                self._close(loop)
            loop = self.loops[runner.key] = StepLoop(runner, self.server.worker_id)
            loop.freed = self.freed.get(runner.key, 0)
        return loop

    def admit(self, batch: Batch, runner: GeneratorRunner) -> Done:
        """Take the batch's requests in as sequences; its answer (a Done without outputs)."""
        mail = self.server.mail
        gone = mail.launch(batch.batch_id)
        if gone:
            mail.report(batch.batch_id, sorted(gone))
        if batch.deadline and time.monotonic() > batch.deadline:
            return error_done(batch, Code.DEADLINE_EXCEEDED, "deadline passed while staged on the worker")
        if batch.cuda_inputs or batch.cuda_outputs:
            return error_done(batch, Code.INVALID_ARGUMENT, f"{runner.label} takes its inputs through shared memory; "
                              "CUDA tensors by IPC handle are for models")
        starts = request_starts(batch)
        if len(batch.sequences) != len(starts) - 1:
            return error_done(batch, Code.INTERNAL, f"{runner.label}: the batch lists {len(batch.sequences)} "
                              f"sequence(s) for {len(starts) - 1} request(s)")
        try:
            columns = {t.name: self._column(t) for t in batch.inputs}
        except BytesTensorError as exc:
            return error_done(batch, Code.INVALID_ARGUMENT, f"{runner.label}: {exc}")
        loop = self.loop_of(runner)
        for i, gs in enumerate(batch.sequences):
            if i in gone:
                continue
            first = starts[i]
            try:
                s = sequence(runner, gs, batch.ids[i] if i < len(batch.ids) else 0, starts[i + 1] - first,
                             {name: col[first] for name, col in columns.items()}, loop.tokens)
            except Refused as exc:
                loop.refuse(gs.seq, exc.code, str(exc))
            else:
                loop.admit(s)
        return Done(batch_id=batch.batch_id)

    def _column(self, t: BlockTensor):
        """One input of the batch, indexable by row: a ring view, or a bytes input's rows."""
        if t.dtype != BYTES:
            return self.server.view(t)
        count = math.prod(t.shape)
        flat = unpack(self.server.segment.buf[t.offset:t.offset + t.nbytes], count) if count or t.nbytes else []
        return _nested(flat, t.shape) if len(t.shape) > 1 else flat

    def cancel(self, msg: CancelSequences) -> None:
        for loop in self.loops.values():
            loop.cancel(msg.seqs, msg.reason)

    def iterate(self) -> None:
        """One iteration of each generator with work, each told in its own Steps."""
        self.read = 0
        for key, loop in list(self.loops.items()):
            if self.server.runners.get(key) is not loop.runner:
                self._close(loop)
                continue
            if loop.busy:   # the newcomers' first outputs go out before the running rows' step
                steps = loop.iterate(early=self.server.mail.send)
                if steps is not None:
                    self.server.mail.send(steps)
            if not loop.live and not loop.busy:   # idle: the loop goes (the runner keeps the pool)
                self.freed[key] = loop.freed
                del self.loops[key]

    def _close(self, loop: StepLoop) -> None:
        steps = loop.close(Code.MODEL_NOT_READY, f"{loop.runner.label} was unloaded while generating")
        if steps is not None:
            self.server.mail.send(steps)
        self.freed[loop.key] = loop.freed
        if self.loops.get(loop.key) is loop:
            del self.loops[loop.key]
