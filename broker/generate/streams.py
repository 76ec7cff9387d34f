"""The live sequences of every generator (docs/GENERATION.md): what the broker does between a
generation's dispatch and its end. The one writer of each generator's GeneratorCounters.

* Slots: a worker takes as many sequences of a generator as its slot pool holds (ModelLoaded.slots,
  then each Steps'); `room` is what the core's pump may still dispatch to it (slots less the
  sequences it holds, admission batches in flight included).
* Streams out: each Steps message's rows go to their callers at once, one GenerateOutputs per
  caller's sequence (the rows one Steps carries for it, coalesced), then a SeqEnd becomes the
  GenerateEnd (or the error) that closes the stream: the last output always precedes it.
* A slow reader: a caller whose replies libzmq still holds pass generator.max_unread_outputs
  outputs (or server.client_queue_bytes), or whose queue is full, has its sequence ended with
  OVERLOADED; the worker is told (CancelSequences) and frees the slot.
* Cancellation: a native cancel, a caller leaving or gone, a deadline: the caller is answered (a
  cancelled stream as a cancelled one-shot request: not at all, its cancel's reply counts it;
  a deadline with DEADLINE_EXCEEDED), the worker told; the slot counts as taken until the
  worker's Steps says the sequence ended.
* A worker's death: each of its running sequences is re-queued at the front with the outputs
  already sent (GenSeq.delivered/prefix), so its prefill continues where the caller's stream is;
  one running at two deaths is answered WORKER_DIED.
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Callable

from tgw.shm.errors import Code, TgwError, error_from_body, fail
from tgw.shm.wire import PROTOCOL_VERSION, CancelSequences, ErrorReply, GenerateEnd, GenerateOutputs, ModelLoaded, \
    Steps, TensorMeta, split_model_key

from tgw.broker.state.generation import GeneratorCounters

from .stream import ADMITTING, QUEUED, RUNNING, Stream

log = logging.getLogger("tgw.broker")
# a reply is tracked every max_unread_outputs / TRACK_STEPS outputs (a tracked send costs ~20x an
# untracked one): a slow reader is noticed within an eighth of its bound
TRACK_STEPS = 8
# a stream's closing message (its end, or its error) that its caller's full queue refused is sent
# again at each sweep for this long, a bounded number of them: a stream ends, it never hangs
OWED_S, OWED_MAX = 60.0, 65536


class Streams:
    def __init__(self, models: dict, clock: Callable[[], float], send_out: Callable, finished: Callable,
                 to_worker: Callable, stats, max_bytes: int):
        """`models`: the registry's entries by name; `send_out(ident, msg, *frames)`: a reply sent
        with a tracker -> (why not sent, tracker); `finished(p, code, now)`: admission's
        accounting of an exit; `to_worker(ident, msg)`; `stats`: the counters its errors and
        replies count in; `max_bytes`: a caller's unread bytes at most (server.client_queue_bytes)."""
        self.models, self.clock, self.send_out = models, clock, send_out
        self.finished, self.to_worker, self.stats, self.max_bytes = finished, to_worker, stats, max_bytes
        self.table: dict[int, Stream] = {}           # seq -> its stream, from its first dispatch to its end
        self.by_batch: dict[int, list[Stream]] = {}  # admission batch id -> its streams, until its Done
        # (worker identity, key) -> its slot pool's size, summed per model for the counters (the
        # worker's handle keeps its own, and the sequences it holds: state/pool.py, its one writer)
        self.slots: dict[tuple, int] = {}
        self._freed: dict[tuple, int] = {}           # (worker identity, key) -> its last Steps.freed
        self.counters: dict[str, GeneratorCounters] = {}   # model -> its figures (status, /metrics)
        self.owed: deque = deque()   # (caller, closing message, since): refused by a full queue, sent again

    def of(self, model: str) -> GeneratorCounters:
        c = self.counters.get(model)
        if c is None:
            c = self.counters[model] = GeneratorCounters()
        return c

    # ---- slots (the core's pump) ---------------------------------------------------------------

    def room(self, w, key: str, model: str) -> int:
        """Sequences of `key` the worker may still be sent (its slots less those it holds)."""
        n = w.slots.get(key)
        if n is None:   # a worker that did not say: the declared pool, else one admission batch
            g = self.models[model].decl.generator
            n = g.max_sequences or self.models[model].decl.max_batch_size
        return n - w.sequences.get(key, 0)

    def loaded(self, w, msg: ModelLoaded) -> None:
        """A generator's load ended on a worker: its pool's size."""
        if msg.error is None and msg.slots:
            self._sized(w, msg.key, msg.slots)

    def _sized(self, w, key: str, slots: int) -> None:
        if self.slots.get((w.identity, key)) != slots:
            w.slots_known(key, slots)
            self.slots[w.identity, key] = slots
            self._recount(split_model_key(key)[0])

    def _recount(self, model: str) -> None:
        self.of(model).slots = sum(n for (_, key), n in self.slots.items() if split_model_key(key)[0] == model)

    # ---- admission batches (the core) --------------------------------------------------------

    def dispatched(self, w, batch_id: int, key: str, ps: list) -> None:
        """An admission batch went to `w`: its sequences hold slots there from now on."""
        model = ps[0].model
        outputs = self.models[model].outputs
        streams = []
        for p in ps:
            s = self.table.get(p.generate.seq)
            if s is None:
                s = self.table[p.generate.seq] = Stream(p, outputs)
            s.on(w, key, batch_id)
            streams.append(s)
        w.sequences_taken(key, len(ps))
        self.by_batch[batch_id] = streams

    def admitted(self, ps: list, now: float) -> None:
        """The worker took these sequences into its loop (its Done): they run."""
        for p in ps:
            s = self.table.get(p.generate.seq)
            if s is not None and s.phase == ADMITTING:
                self._runs(s)

    def _runs(self, s: Stream) -> None:
        s.phase = RUNNING
        c = self.of(s.p.model)
        c.started += 1
        c.active += 1

    def batch_done(self, batch_id: int, taken: list) -> None:
        """An admission batch's last completion: `taken`, requests withdrawn after the worker
        took them in (nobody waits: the worker is told to end them); the batch's other sequences
        not running now were never started and free their slots."""
        streams = self.by_batch.pop(batch_id, ())
        if taken:
            for p in taken:
                s = self.table.get(p.generate.seq)
                if s is not None and s.phase == ADMITTING:
                    self._runs(s)
                    self.to_worker(s.worker.identity, CancelSequences(seqs=[s.seq], reason="cancelled"))
        for s in streams:
            if s.phase == ADMITTING and s.batch_id == batch_id:
                self._forget(s)

    def _forget(self, s: Stream) -> None:
        """Out of the table; the slot it held on its worker is free."""
        self.table.pop(s.seq, None)
        if s.phase in (ADMITTING, RUNNING) and s.worker is not None:
            s.worker.sequence_freed(s.key)
            if s.phase == RUNNING:
                self.of(s.p.model).active -= 1
        s.phase, s.worker = QUEUED, None

    # ---- exits (admission's hook) --------------------------------------------------------------

    def exits(self, ps: list, code: str | None, now: float) -> None:
        """Requests leaving the broker: a generation answered by someone else (expired in its
        queue, withdrawn from its admission batch, failed by its worker) is closed here."""
        if ps[0].generate is None or code is None:
            return
        for p in ps:
            s = self.table.get(p.generate.seq)
            if s is None or s.closed:
                continue
            s.closed = True
            if s.phase == QUEUED:
                self._forget(s)
            elif s.phase == RUNNING:   # nobody else answers a running one; defensive
                self.to_worker(s.worker.identity, CancelSequences(seqs=[s.seq], reason="cancelled"))
            # admitting: its batch's Done says whether the worker took it in

    # ---- cancellation (front/abandon.py) ------------------------------------------------------

    def cancel(self, p) -> bool:
        """A native cancel of `p`: True if it was a running generation (now ended, unanswered)."""
        s = self.table.get(p.generate.seq) if p.generate is not None else None
        if s is None or s.closed or s.phase != RUNNING:
            return False   # queued or admitting: withdrawn as any request
        self._close(s, self.clock(), "ABANDONED", "cancelled")
        return True

    def drop(self, wanted: Callable) -> list:
        """The running generations `wanted(p)` picks (their callers left or are gone): ended,
        unanswered; their requests."""
        hits = [s for s in self.table.values() if s.phase == RUNNING and not s.closed and wanted(s.p)]
        now = self.clock()
        for s in hits:
            self._close(s, now, "ABANDONED", "cancelled")
        return [s.p for s in hits]

    def sweep(self, now: float) -> None:
        """The periodic look: running generations past their deadline; closing messages a full
        queue refused, sent again (in order, per caller)."""
        late = [s for s in self.table.values() if s.phase == RUNNING and not s.closed and s.p.deadline <= now]
        for s in late:
            self._expire(s, now)
        if self.owed:
            owed, self.owed, full = self.owed, deque(), set()
            for ident, msg, since in owed:
                if ident in full or self.send_out(ident, msg)[0] == "full":
                    full.add(ident)
                    if now - since < OWED_S:
                        self.owed.append((ident, msg, since))
                    else:
                        log.warning("generation %d's closing message dropped: its caller read nothing for %.0f s",
                                    msg.id, OWED_S)

    def _expire(self, s: Stream, now: float) -> None:
        self._close(s, now, None, "deadline", fail(Code.DEADLINE_EXCEEDED, f"deadline passed after {s.sent} "
                    f"output(s) of {s.gen.max_outputs}", outputs=s.sent))

    def _close(self, s: Stream, now: float, code: str | None, worker_reason: str | None,
               err: TgwError | None = None) -> None:
        """Answer the caller (`err`, or nothing: a cancelled stream's cancel answered it) and
        tell the worker to end the sequence (`worker_reason`); its slot frees at the worker's end."""
        s.closed = True
        if err is not None:
            self._fail(s.p, err, now)
        else:
            self.finished(s.p, code, now)
        if worker_reason is not None and s.phase == RUNNING and s.worker is not None:
            self.to_worker(s.worker.identity, CancelSequences(seqs=[s.seq], reason=worker_reason))

    # ---- what the worker's loop sends ----------------------------------------------------------

    def on_steps(self, w, msg: Steps) -> bool:
        """One step of a worker's loop: outputs to callers, ends answered; True if a slot freed."""
        now = self.clock()
        model = split_model_key(msg.key)[0]
        c = self.of(model)
        c.steps += 1
        ident = w.identity
        if msg.slots:
            self._sized(w, msg.key, msg.slots)
        freed = msg.freed - self._freed.get((ident, msg.key), 0)
        if freed > 0:
            c.freed_by_cancel += freed
            self._freed[ident, msg.key] = msg.freed
        if msg.seqs:
            self._outputs(w, msg, c, now)
        for end in msg.ended:
            s = self.table.get(end.seq)
            if s is None or s.worker is not w:
                continue   # a sequence this worker no longer holds for the broker
            self._forget(s)
            c.ended[end.reason] += 1
            if not s.closed:
                self._end(s, end, now)
        return bool(msg.ended)

    def _outputs(self, w, msg: Steps, c: GeneratorCounters, now: float) -> None:
        rows = len(msg.seqs)
        widths = [len(o.data) // rows if rows else 0 for o in msg.outputs]
        by_seq: dict[int, list[int]] = {}
        for i, seq in enumerate(msg.seqs):
            by_seq.setdefault(seq, []).append(i)
        for seq, idx in by_seq.items():
            s = self.table.get(seq)
            if s is None or s.closed or s.worker is not w:
                continue   # ended for its caller already: the worker is being told
            if s.phase == ADMITTING:   # its outputs overtook its batch's Done: it runs
                self._runs(s)
            idx = [i for i in idx if msg.positions[i] >= s.sent]   # sent already (never twice)
            if not idx:
                continue
            if [msg.positions[i] for i in idx] != list(range(s.sent, s.sent + len(idx))):   # a gap
                log.error("generation %d: positions %s from %s where %d was next", seq,
                          [msg.positions[i] for i in idx], w.name, s.sent)
                self._close(s, now, None, "error", fail(Code.INTERNAL, f"the worker sent output positions "
                            f"{[msg.positions[i] for i in idx]} where {s.sent} was next"))
                continue
            self._send(s, msg, idx, widths, c, now)
            if not s.closed and s.p.deadline <= now:
                self._expire(s, now)

    def _send(self, s: Stream, msg: Steps, idx: list[int], widths: list[int], c: GeneratorCounters,
              now: float) -> None:
        p, n = s.p, len(idx)
        metas, frames = [], []
        for o, width in zip(msg.outputs, widths):
            rows = b"".join(o.data[i * width:(i + 1) * width] for i in idx) if n > 1 else \
                o.data[idx[0] * width:(idx[0] + 1) * width]
            s.kept[o.name] += rows
            if o.name in p.outputs:
                metas.append(TensorMeta(name=o.name, dtype=o.dtype, shape=[n, *o.shape[1:]]))
                frames.append(rows)
        entry = self.models.get(p.model)   # None: unloaded while it ran
        limit = entry.decl.generator.max_unread_outputs if entry is not None else 1024
        track = s.sent - s.tracked_at >= max(1, limit // TRACK_STEPS)
        why, tracker = self.send_out(p.client, GenerateOutputs(v=PROTOCOL_VERSION, id=p.req_id, first=s.sent,
                                                               count=n, outputs=metas), *frames, track=track)
        if why == "gone":   # the caller's connection is gone: nobody to answer
            return self._close(s, now, "ABANDONED", "cancelled")
        if why:
            return self._slow(s, now, "its queue is full (server.client_queue_messages)")
        s.went_out(n, sum(map(len, frames)), tracker)
        c.outputs += n
        if s.first_at is None:
            s.first_at = now
            c.first_output.observe(now - p.arrived)
        else:
            c.between_outputs.observe(now - s.last_at)
        s.last_at = now
        held, nbytes = s.held()
        if held > limit:
            self._slow(s, now, f"{held} outputs unread (generator.max_unread_outputs {limit})")
        elif nbytes > self.max_bytes:
            self._slow(s, now, f"{nbytes} bytes unread (server.client_queue_bytes {self.max_bytes})")

    def _slow(self, s: Stream, now: float, why: str) -> None:
        self._close(s, now, None, "slow_reader", fail(
            Code.OVERLOADED, f"the caller did not read its outputs: {why}; its sequence is ended and its slot "
            f"freed after {s.sent} output(s)", reason="slow_reader", outputs=s.sent))

    def _end(self, s: Stream, end, now: float) -> None:
        p = s.p
        s.closed = True
        if end.reason == "error":
            err = error_from_body(end.error) if end.error is not None else \
                fail(Code.MODEL_EXECUTION_ERROR, "the generator failed this sequence")
            return self._fail(p, err, now)
        if end.reason == "cancelled":   # the broker did not ask: a worker-side end
            return self._fail(p, fail(Code.INTERNAL, "the worker cancelled this sequence unasked"), now)
        self.finished(p, None, now)
        self.stats.models[p.model].replies += 1
        first = (s.first_at - p.arrived) * 1000 if s.first_at is not None else 0.0
        self._deliver(p.client, GenerateEnd(v=PROTOCOL_VERSION, id=p.req_id, model=p.model, version=p.version,
                                            reason=end.reason, outputs=s.sent, seed=s.gen.sampling.seed,
                                            first_output_ms=round(first, 3),
                                            total_ms=round((now - p.arrived) * 1000, 3), resumed=s.resumed,
                                            traceparent=p.trace), now)

    def _fail(self, p, err: TgwError, now: float) -> None:
        """An admitted generation answered with an error (the door's fail, but through send_out:
        a caller whose queue is full gets it at a later sweep)."""
        self.finished(p, err.code.value, now)
        self.stats.error(p.model, err.code.value)
        err.details.setdefault("model", p.model)
        self._deliver(p.client, ErrorReply(v=PROTOCOL_VERSION, id=p.req_id, error=err.to_body(), traceparent=p.trace),
                      now)

    def _deliver(self, ident, msg, now: float) -> None:
        """A stream's closing message; kept for the sweep when the caller's queue is full."""
        if self.send_out(ident, msg)[0] == "full" and len(self.owed) < OWED_MAX:
            self.owed.append((ident, msg, now))

    # ---- a worker's death (the core) ----------------------------------------------------------

    def lost(self, w, retry: bool = True) -> list:
        """`w`'s process is gone: its running sequences to re-queue at the front (the outputs
        sent ride along as their prefix); one at its second death is answered WORKER_DIED. Its
        admission batches are the handshake's (retried once, as any batch): their streams wait
        queued. `retry` False (the broker is stopping): each is answered WORKER_DIED."""
        again = []
        for s in sorted((s for s in self.table.values() if s.worker is w), key=lambda s: s.seq):
            running = s.phase == RUNNING
            self.by_batch.pop(s.batch_id, None)   # its admission batch's Done never comes (a retry is a new batch)
            self._forget(s)
            if s.closed:
                continue
            self.table[s.seq] = s   # still owed to its caller
            if not running:
                continue
            p = s.p
            p.attempts += 1
            if p.attempts >= 2 or not retry:
                s.closed = True
                self.table.pop(s.seq, None)
                if not retry:   # the broker is stopping
                    self._fail(p, fail(Code.WORKER_DIED, f"{w.name} ended while this generation ran "
                                       f"({w.last_death}); the broker is stopping", outputs=s.sent), self.clock())
                    continue
                log.error("generation %d of %s running at two worker deaths: not retried", s.seq, p.model,
                          extra={"event": "poison_request", "request_id": p.req_id, "model": p.model})
                self._fail(p, fail(Code.WORKER_DIED, f"generation {p.req_id} of {p.model!r} killed its worker "
                                   f"twice ({w.name}: {w.last_death}): not retried", worker_deaths=p.attempts,
                                   poison=True, outputs=s.sent), self.clock())
                continue
            s.requeued()
            p.take_back()
            self.of(p.model).resumed += 1
            again.append(p)
        for k in [k for k in self.slots if k[0] == w.identity]:
            del self.slots[k]
            self._recount(split_model_key(k[1])[0])
        for k in [k for k in self._freed if k[0] == w.identity]:
            del self._freed[k]
        return again
