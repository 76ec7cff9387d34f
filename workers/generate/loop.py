"""A generator's step loop on its worker (docs/GENERATION.md "The step loop"): continuous
batching over the sequences it holds, one iteration at a time, each told to the broker as ONE
`Steps` message.

An iteration:
  (a) applies the cancels that arrived since the last one: each row leaves, its slot goes back to
      the pool and counts in `freed`, and its SeqEnd carries the CancelSequences reason;
  (b) prefills up to max_prefill_rows newcomers in ONE prefill call: their first outputs;
  (c) steps every row that was running before this iteration in ONE step call (newcomers join
      the next iteration: a newcomer's first output never waits for others to finish);
  (d) makes one Steps: each emitted output's row, the sequences that ended (after their last
      output), the loop's counts.
The serving loop passes `early`: the newcomers' first outputs then go out in a Steps of their
own as soon as (b) is done, not after (c) - a newcomer's first output waits for its prefill
only, not for the step of the rows already running.
A sequence gets its slot as it is admitted (from the broker's batch); with none free it is ended
at once (OVERLOADED: the broker sends a generator batch only to a worker with free slots, so
this is a race or a bug, never a wait). Ended rows give their slot back at once; the next
iteration's batch holds only live rows (compacted). A handler that raises ends the rows of that
call (MODEL_EXECUTION_ERROR naming the exception and the handler's file:line), logs one WARNING
and leaves the loop serving; a row the handler failed ends INVALID_ARGUMENT with its message.

One writer: the serving loop's thread owns a StepLoop and everything in it.
"""
from __future__ import annotations

import heapq
import logging
import time
from collections import deque
from typing import Callable, Optional

import torch

from tgw.shm.errors import Code, TgwError, fail
from tgw.shm.wire import ErrorBody, SeqEnd, StepRows, Steps

from ..cuda_faults import fault_of
from ..oom import is_oom, oom_text
from .returns import ReturnError, sampleable
from .sampling import bad_rows
from .sequence import Sequence
from .stops import CANCELLED, ERROR, MAX_LENGTH, MAX_OUTPUTS, STOP_SEQUENCE, STOP_TOKEN, after_emit

log = logging.getLogger("tgw.worker")
LINES_PER_S = 5   # failure lines a second per generator, at most (as failure_log.py's)


class StepLoop:
    def __init__(self, runner, worker_id: int = 0):
        self.runner, self.worker_id = runner, worker_id
        self.gen = runner.gen
        self.free = list(range(runner.slots))     # a heap: the lowest free slot first
        self.live: dict[int, Sequence] = {}       # seq id -> every sequence holding a slot
        self.newcomers: deque[Sequence] = deque()
        self.active: list[Sequence] = []          # the rows of the next step, in order
        self.last: dict[str, torch.Tensor] = {}   # their last outputs, [rows, *shape] per declared output
        self.cancels: dict[int, str] = {}         # seq id -> reason, applied at the next iteration
        self.ended: list[SeqEnd] = []             # told in the next Steps
        self.freed = 0                            # slots freed by cancellation (a count, since start)
        self.tokens = sampleable(runner.outputs)  # stop tokens and sequences apply
        self._lines = (0.0, 0)                    # failure lines: window start, lines in it
        self._left_out = 0                        # failure lines not logged since the last one

    @property
    def key(self) -> str:
        return self.runner.key

    @property
    def busy(self) -> bool:
        """Whether an iteration has something to do or tell."""
        return bool(self.newcomers or self.active or self.cancels or self.ended)

    @property
    def free_slots(self) -> int:
        return len(self.free)

    # ---- admission and cancels (from the serving loop's messages) ----------------------------

    def admit(self, s: Sequence) -> None:
        """A new sequence: it takes a slot now and is prefilled at a coming iteration."""
        if s.seq in self.live:
            self.refuse(s.seq, Code.INVALID_ARGUMENT, f"sequence {s.seq} is already in {self.runner.label}'s loop")
            return
        if not self.free:
            self.refuse(s.seq, Code.OVERLOADED, f"{self.runner.label}: no free state slot (all {self.runner.slots} "
                        "hold sequences)")
            return
        s.slot = heapq.heappop(self.free)
        self.live[s.seq] = s
        self.newcomers.append(s)

    def refuse(self, seq: int, code: Code, message: str) -> None:
        """End a sequence that never took a slot (told at the next iteration)."""
        self.ended.append(SeqEnd(seq=seq, reason=ERROR, error=fail(code, message).to_body()))

    def cancel(self, seqs: list[int], reason: str = CANCELLED) -> None:
        """End these sequences at the next iteration (those not here are ended already)."""
        for q in seqs:
            if q in self.live:
                self.cancels.setdefault(q, reason)

    def close(self, code: Code, message: str) -> Optional[Steps]:
        """End every live sequence with an error (the generator was unloaded): the last Steps."""
        for s in list(self.live.values()):
            self._end(s, ERROR, fail(code, message).to_body())
        self.newcomers.clear()
        self.active, self.last, self.cancels = [], {}, {}
        return self._steps(_Rows(self.runner.outputs), 0, 0)

    # ---- one iteration -----------------------------------------------------------------------

    def iterate(self, early: Optional[Callable[[Steps], None]] = None) -> Optional[Steps]:
        """One iteration; its Steps (None when it had nothing to tell). With `early`, what the
        cancels and the prefill told is handed to it before the step runs, and the Steps
        returned holds the step's rows only."""
        t0 = time.perf_counter()
        if self.cancels:
            for q, reason in self.cancels.items():
                s = self.live.get(q)
                if s is not None:
                    self._end(s, reason)
                    self.freed += 1
            self.cancels = {}
            alive = [i for i, s in enumerate(self.active) if s.seq in self.live]
            if len(alive) < len(self.active):   # compacted: the rows and their last outputs
                self.active = [self.active[i] for i in alive]
                self.last = {k: v[alive] for k, v in self.last.items()}
            self.newcomers = deque(s for s in self.newcomers if s.seq in self.live)
        rows = _Rows(self.runner.outputs)
        stepping, last, self.active, self.last = self.active, self.last, [], {}
        take = [self.newcomers.popleft() for _ in range(min(self.gen.max_prefill_rows, len(self.newcomers)))]
        joined = self._prefill(take, rows) if take else _Went()
        if early is not None and stepping and (rows.seqs or self.ended):
            early(self._steps(rows, int((time.perf_counter() - t0) * 1e6), len(take)))
            rows, take, t0 = _Rows(self.runner.outputs), [], time.perf_counter()
        kept = self._step(stepping, last, rows) if stepping else _Went()
        # the next step's rows: the stepped ones that go on, then the newcomers that joined
        self.active = kept.seqs + joined.seqs
        parts = [w for w in (kept, joined) if w.seqs]
        if parts:
            self.last = {t.name: torch.cat([w.values[t.name][w.index] for w in parts]) for t in self.runner.outputs}
        return self._steps(rows, int((time.perf_counter() - t0) * 1e6), len(take))

    def _steps(self, rows: "_Rows", step_us: int, prefilled: int) -> Optional[Steps]:
        if not rows.seqs and not self.ended:
            return None
        ended, self.ended = self.ended, []
        return Steps(worker_id=self.worker_id, key=self.key, seqs=rows.seqs, positions=rows.positions,
                     outputs=rows.wire() if rows.seqs else [], ended=ended, active=len(self.live),
                     slots=self.runner.slots, freed=self.freed, step_us=step_us, prefilled=prefilled)

    def _prefill(self, take: list[Sequence], rows: "_Rows") -> "_Went":
        ready = []
        for s in take:
            # a resumed sequence whose delivered outputs had ended it (its worker died before the
            # broker heard of the end): it ends as the uninterrupted run did, after_emit's order
            if s.delivered and s.stops.ended():
                self._end(s, STOP_SEQUENCE)
            elif s.produced >= s.max_outputs:
                self._end(s, MAX_OUTPUTS)
            elif not self._fits(s):
                pass
            else:
                ready.append(s)
        if not ready:
            return _Went()
        inputs = {name: [s.inputs[name] for s in ready] for name in ready[0].inputs}
        prefix = {t.name: [s.prefix[t.name] for s in ready] for t in self.runner.outputs}
        try:
            returned, failed = self.runner.prefill(inputs, prefix, [s.slot for s in ready])
        except Exception as exc:
            self._fail(ready, "prefill", exc)
            return _Went()
        for s in ready:
            s.release_inputs()
        if returned.lengths is not None:
            lengths = returned.lengths
            for i, s in enumerate(ready):
                s.prompt_len = lengths[i]
                if i not in failed:
                    self._fits(s, told=True)   # one that does not fit ends here; _emit passes it by
        return self._emit(ready, returned, failed, rows)

    def _fits(self, s: Sequence, told: bool = False) -> bool:
        """Whether the prompt (and the outputs a resumed sequence appends) fits max_length; if
        not, the sequence ends INVALID_ARGUMENT saying the numbers."""
        limit = self.gen.max_length
        if not limit or s.prompt_len is None or s.prompt_len + s.delivered <= limit:
            return True
        if s.delivered and s.prompt_len + s.delivered - 1 >= limit:   # resumed: its last output had ended it
            self._end(s, MAX_LENGTH)
            return False
        said = "prefill said its prompt takes" if told else "its prompt takes"
        also = f" and {s.delivered} output(s) already delivered" if s.delivered else ""
        self._end(s, ERROR, fail(Code.INVALID_ARGUMENT, f"{self.runner.label}: {said} {s.prompt_len} position(s){also}; "
                                 f"the generator's max_length is {limit}", reason="max_length").to_body())
        return False

    def _step(self, stepping: list[Sequence], last: dict[str, torch.Tensor], rows: "_Rows") -> "_Went":
        try:
            returned, failed = self.runner.step(last, [s.position for s in stepping], [s.slot for s in stepping])
        except Exception as exc:
            self._fail(stepping, "step", exc)
            return _Went()
        return self._emit(stepping, returned, failed, rows)

    def _emit(self, seqs: list[Sequence], returned, failed: dict, rows: "_Rows") -> "_Went":
        """Each row's output picked, checked against its ends and emitted; the rows that go on."""
        values = self.runner.values(returned, [s.temperature for s in seqs], [s.top_k for s in seqs],
                                    [s.top_p for s in seqs], [s.seed for s in seqs], [s.produced for s in seqs])
        bad = set(bad_rows(returned.logits)) if returned.logits is not None else set()
        name = self.runner.outputs[0].name
        tokens = values[name].tolist() if self.tokens else None
        went, emitted, positions = _Went(values), [], []
        for i, s in enumerate(seqs):
            if s.seq not in self.live:
                continue
            if i in failed:
                self._end(s, ERROR, fail(Code.INVALID_ARGUMENT, f"{self.runner.label}: {failed[i]}",
                                         reason="generator_row_failed").to_body())
                continue
            if i in bad:
                self._end(s, ERROR, fail(Code.MODEL_EXECUTION_ERROR, f"{self.runner.label}: the logits of sequence "
                                         f"{s.seq} at output {s.produced} hold no valid value (NaN, +inf or all "
                                         "-inf)").to_body())
                continue
            if tokens is not None and s.stops.is_stop_token(tokens[i]):
                self._end(s, STOP_TOKEN)
                continue
            emitted.append(i)
            positions.append(s.produced)
            s.produced += 1
            hit = tokens is not None and s.stops.emitted(tokens[i])
            reason = after_emit(hit, bool(returned.done[i]) if returned.done is not None else False, s.produced,
                                s.max_outputs, s.prompt_len + s.produced - 1, self.gen.max_length)
            if reason is None:
                went.seqs.append(s)
                went.index.append(i)
            else:
                self._end(s, reason)
        rows.add([seqs[i].seq for i in emitted], positions, values, emitted)
        return went

    def _fail(self, seqs: list[Sequence], phase: str, exc: Exception) -> None:
        """A prefill or step that raised (or returned what breaks the contract): its rows end."""
        if fault_of(exc, None) is not None:   # a sticky CUDA error: the worker is done (serve.py)
            raise exc
        where = self.runner.blame(phase, exc)
        at = f" ({'returned by' if isinstance(exc, ReturnError) else 'at'} {where})" if where else ""
        if is_oom(exc):
            body = fail(Code.OUT_OF_GPU_MEMORY, oom_text(exc)).to_body()
        elif isinstance(exc, TgwError):
            body = exc.to_body()
        elif isinstance(exc, ReturnError):
            body = fail(Code.MODEL_EXECUTION_ERROR, f"{self.runner.label}: {exc}{at}").to_body()
        else:
            body = fail(Code.MODEL_EXECUTION_ERROR, f"{self.runner.label}: {phase} raised {type(exc).__name__}: "
                        f"{str(exc)[:2000]}{at}", exception=type(exc).__name__).to_body()
        for s in seqs:
            if s.seq in self.live:
                self._end(s, ERROR, body)
        self._warn(phase, seqs, body)

    def _warn(self, phase: str, seqs: list[Sequence], body: ErrorBody) -> None:
        """One WARNING line per failed call, at most LINES_PER_S a second (the next says how many
        were left out), as failure_log.py's batch_failed."""
        now = time.monotonic()
        start, lines = self._lines
        if now - start >= 1.0:
            start, lines = now, 0
        self._lines = (start, lines + 1)
        if lines >= LINES_PER_S:
            self._left_out += 1
            return
        left_out, self._left_out = self._left_out, 0
        ids = [s.request_id for s in seqs if s.request_id]
        log.warning("%s failed %s: %s of %d sequence(s)%s: %s%s", self.key, body.code, phase, len(seqs),
                    f" (ids {' '.join(map(str, ids[:16]))})" if ids else "", body.message,
                    f" ({left_out} more failure line(s) of {self.key} left out)" if left_out else "",
                    extra={"event": "generation_failed", "model": self.runner.spec.name,
                           "version": self.runner.spec.version, "code": body.code, "phase": phase,
                           "sequences": len(seqs), "seqs": [s.seq for s in seqs[:16]], "request_ids": ids[:16],
                           "left_out": left_out})

    def _end(self, s: Sequence, reason: str, error: Optional[ErrorBody] = None) -> None:
        """The sequence leaves: its slot back to the pool now, its end told in the next Steps."""
        if self.live.pop(s.seq, None) is None:
            return
        heapq.heappush(self.free, s.slot)
        s.release_inputs()
        self.ended.append(SeqEnd(seq=s.seq, reason=reason, error=error))


class _Went:
    """The rows of one call that go on: their sequences, and where their outputs are in `values`."""

    def __init__(self, values: Optional[dict[str, torch.Tensor]] = None):
        self.values = values or {}
        self.seqs: list[Sequence] = []
        self.index: list[int] = []


class _Rows:
    """The outputs an iteration emits, a call's rows at a time, made into Steps fields at its end."""

    def __init__(self, outputs):
        self.outputs = outputs
        self.seqs: list[int] = []
        self.positions: list[int] = []
        self.parts: list[tuple[dict[str, torch.Tensor], list[int]]] = []   # (a call's values, the rows emitted)

    def add(self, seqs: list[int], positions: list[int], values: dict[str, torch.Tensor], index: list[int]) -> None:
        if seqs:
            self.seqs += seqs
            self.positions += positions
            self.parts.append((values, index))

    def wire(self) -> list[StepRows]:
        out = []
        for t in self.outputs:
            stacked = torch.cat([values[t.name][index] for values, index in self.parts]).contiguous()
            out.append(StepRows(name=t.name, dtype=t.dtype, shape=list(stacked.shape),
                                data=stacked.reshape(-1).view(torch.uint8).numpy().tobytes()))
        return out
