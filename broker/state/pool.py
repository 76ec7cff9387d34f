"""The broker's side of each worker: its ring, its in-flight batches, staging and slicing.

The broker writes the input arena (allocates, copies a batch's rows contiguously per input)
and reads the output arena (slices each request's rows, then releases the block).
The batches in flight are Inflight records (inflight.py), withdrawals from them included.
"""
from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from enum import Enum

from tgw.shm.ring import RingAllocator, aligned_total, region_offsets
from tgw.shm.segment import Segment
from tgw.shm.wire import BYTES, Batch, BlockTensor, Done, Footprint, Heartbeat, IOSpec, Withdraw, model_key

from .inflight import Gone, Inflight, drop_from, left_out, take_out  # noqa: F401 - Inflight: its home for callers
from .pending import Pending, attach_cuda, gpu_fits, is_shadow, plain_dims


class WorkerState(str, Enum):
    PLANNED = "planned"      # ring made, no process yet
    STARTING = "starting"    # process spawned: handshake, loading its models (each takes batches once in)
    READY = "ready"          # serving the versions in `models`
    STOPPING = "stopping"    # told to stop: finishes what it holds, then exits
    DEAD = "dead"            # process gone; the supervisor may restart it on a fresh ring


_NEXT = {
    WorkerState.PLANNED: {WorkerState.STARTING},
    WorkerState.STARTING: {WorkerState.READY, WorkerState.STOPPING, WorkerState.DEAD},
    WorkerState.READY: {WorkerState.STOPPING, WorkerState.DEAD},
    WorkerState.STOPPING: {WorkerState.DEAD},
    WorkerState.DEAD: {WorkerState.STARTING},
}


class IllegalTransition(RuntimeError):
    """A broker bug: a worker moved along an edge its life cycle does not have."""


@dataclass
class Holding:
    """What one life of a worker is doing with run-time versions. Read by placement and residency
    (models/); changed only through WorkerHandle's methods (what each load, unload, eviction and
    dispatch did), like every field of the handle."""
    loader_ready: bool = False                                  # its loader thread said hello
    loading: dict[str, float] = field(default_factory=dict)     # key -> when its load was sent
    unloading: set[str] = field(default_factory=set)
    evicting: set[str] = field(default_factory=set)   # loaded, no longer wanted: no new batches, unloaded once idle
    wanted: set[str] = field(default_factory=set)     # on-demand versions placed on it
    used_at: dict[str, float] = field(default_factory=dict)  # key -> last batch dispatched (LRU goes first)
    unloads: int = 0                                  # unloads done in this life (fragmentation is judged after one)


@dataclass
class LoadUnderWay:
    """One load a worker's loader thread is doing now, as its LoadPhase messages told it, or
    one of its start-up loads waiting for its turn."""
    phase: str          # queued (start-up: waiting for the loads before it), loading, warming
    since: float        # when the load began (the broker's clock, less the worker's seconds so far)


@dataclass
class WorkerHandle:
    """One worker's state. Every field changes only through the methods below, each named for
    what happened (the supervisor spawned it, its hello came, a load finished, ...): this module
    is the one writer, the other wings read. `state` moves only along _NEXT."""
    worker_id: int
    device: str
    cpus: list[int]
    segment: Segment
    input_bytes: int
    output_bytes: int
    generation: int = 0
    proc: subprocess.Popen | None = None
    pid: int = 0
    models: set[str] = field(default_factory=set)     # "name:version" loaded and warmed up
    inflight: dict[int, Inflight] = field(default_factory=dict)
    beat: Heartbeat | None = None     # the last heartbeat of this life ...
    beat_at: float = 0.0              # ... and when it arrived (or when the life began)
    restarts: int = 0
    last_death: str = ""              # why the previous life ended
    kill_reason: str = ""             # set when the supervisor kills this life
    benched: str = ""                 # why its models are unavailable on it (crash loop, device out of service)
    faulted: str = ""                 # this life met a sticky CUDA error (fleet/faults.py): serving no more
    successor: "WorkerHandle | None" = None   # its replacement, while it is being recycled
    retiring: bool = False            # the successor serves: this one takes no new batches
    free_at: float = 0.0              # when the batches it holds are predicted to be done (cost model)
    budget: int | None = None         # bytes its loaded models may take (workers.max_model_memory)
    device_uuid: str = ""             # its GPU's UUID, from its hello (CUDA IPC routing: state/pending.py)
    host_memory: str = ""             # its ring's page-locking in effect on a GPU (hello): register/staging/pageable
    device_memory: int = 0            # its GPU's memory in bytes, from its hello (0: a CPU worker)
    # what it holds (models/roles.py): models, stages (a workers.stage_workers worker) or both
    role: str = "models+stages"
    # key -> the load its loader thread is doing now, start-up ones included (status shows them)
    under_way: dict[str, LoadUnderWay] = field(default_factory=dict)
    # a generator's (docs/GENERATION.md), per key: its slot pool's size, and the sequences it holds
    # for the broker (admission batches in flight and running in its loop; broker/generate/)
    slots: dict[str, int] = field(default_factory=dict)
    sequences: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._state = WorkerState.PLANNED
        self._use_ring(self.segment)

    @property
    def state(self) -> WorkerState:
        return self._state

    def _move(self, to: WorkerState) -> None:
        if to not in _NEXT[self._state]:
            raise IllegalTransition(f"{self.name}: {self._state.value} -> {to.value}")
        self._state = to

    # ---- its life (the supervisor's and the handshake's events) -------------------------------

    def spawned(self, proc: subprocess.Popen | None, now: float = 0.0) -> None:
        self._move(WorkerState.STARTING)
        self.proc, self.pid = proc, proc.pid if proc is not None else 0
        self.beat, self.beat_at, self.kill_reason = None, now, ""

    def introduced(self, pid: int, device_uuid: str, device_memory: int, host_memory: str) -> None:
        """Its hello: its process id, its GPU's UUID and memory, its ring's page-locking."""
        self.pid, self.device_uuid, self.device_memory, self.host_memory = pid, device_uuid, device_memory, host_memory

    def budgeted(self, budget: int | None) -> None:
        """Its model budget (workers.max_model_memory), known once its hello told its device's size."""
        self.budget = budget

    def became_ready(self, models: list[str], now: float = 0.0, sizes: dict[str, int] | None = None,
                     footprints: dict[str, Footprint] | None = None) -> None:
        """Its start-up loads are in: `models`, their bytes and measured footprints."""
        self._move(WorkerState.READY)
        self.models = set(models)
        self.sizes.update(sizes or {})
        self.footprints.update(footprints or {})
        self.beat_at = max(self.beat_at, now)  # silence is judged from here on

    def started_serving(self, key: str, nbytes: int, footprint: Footprint | None) -> None:
        """One start-up model is in, warmed up: it takes batches while the others still load."""
        self.under_way.pop(key, None)
        self.models.add(key)
        self.sizes[key] = nbytes
        if footprint is not None:
            self.footprints[key] = footprint

    def loads_queued(self, keys: list[str], now: float) -> None:
        """The start-up loads it was told, in its loader's order: each waits for the ones before it."""
        for key in keys:
            self.under_way[key] = LoadUnderWay("queued", now)

    def load_moved(self, key: str, phase: str, seconds: float, now: float) -> None:
        """Its loader began a load (phase "loading") or moved it on ("warming"), `seconds` into it."""
        self.under_way[key] = LoadUnderWay(phase, now - seconds)

    def offers(self, key: str) -> bool:
        """It takes batches of this version: ready with it loaded, or still starting with it
        loaded and warmed up (start-up models serve one by one, as each is in)."""
        return key in self.models and (self._state is WorkerState.READY or
                                       (self._state is WorkerState.STARTING and not self.faulted))

    def beat_came(self, beat: Heartbeat, now: float) -> None:
        self.beat, self.beat_at = beat, now

    def told_to_stop(self) -> None:
        self._move(WorkerState.STOPPING)
        self.under_way.clear()   # what it still loads serves nobody

    def met_fault(self, why: str) -> None:
        """A sticky CUDA error (fleet/faults.py): this life serves no more; its death retries what it holds."""
        self.faulted = why
        if self._state is WorkerState.READY:
            self.told_to_stop()

    def killing(self, reason: str) -> None:
        """The supervisor kills this life, for `reason`."""
        self.kill_reason = reason

    def exited(self, why: str = "") -> None:
        """Its process ended (`why`: how, for its next life and the requests it held)."""
        self._move(WorkerState.DEAD)
        self.under_way.clear()
        if why:
            self.last_death = why

    def bench(self, why: str) -> None:
        """Its models are unavailable on it (a crash loop, its device out of service)."""
        self.benched = why

    def unbench(self) -> None:
        self.benched = ""

    def replaced_by(self, successor: "WorkerHandle") -> None:
        """Recycled: `successor` starts in its place; this one serves until it is retired."""
        self.successor = successor

    def retire(self) -> None:
        """Its successor serves: no new batches come to it."""
        self.retiring = True

    def renew(self, segment: Segment) -> None:
        """A dead worker's next life: a fresh ring and identity, nothing loaded, nothing owed."""
        if self._state is not WorkerState.DEAD:
            raise IllegalTransition(f"{self.name}: renewed while {self._state.value}")
        self.generation += 1
        self.restarts += 1
        self.faulted = ""
        self.models.clear()
        self.inflight.clear()
        self.slots.clear()
        self.sequences.clear()
        self._use_ring(segment)

    def drop_inflight(self) -> list[Inflight]:
        """Its batches in flight, taken away (it died, or the shutdown grace ran out)."""
        batches = list(self.inflight.values())
        self.inflight.clear()
        return batches

    # ---- run-time versions (placement and residency, models/) ---------------------------------

    def loader_said_hello(self) -> None:
        self.holding.loader_ready = True

    def load_sent(self, key: str, now: float) -> None:
        self.holding.loading[key] = now

    def want(self, key: str) -> None:
        """An on-demand version placed on it."""
        self.holding.wanted.add(key)

    def unwant(self, keys) -> None:
        """Versions forgotten: not to be loaded here on demand any more."""
        self.holding.wanted.difference_update(keys)

    def keep_only(self, wanted: set[str]) -> None:
        """What it holds beyond `wanted` takes no new batches and unloads once idle."""
        self.holding.evicting |= self.models - wanted

    def evict(self, key: str) -> None:
        """An on-demand version evicted to make room: no new batches, unloaded once idle."""
        self.holding.wanted.discard(key)
        self.holding.evicting.add(key)

    def unload_sent(self, key: str) -> None:
        """An evicted version is idle: it is no longer served here, and its unload is asked."""
        self.holding.evicting.discard(key)
        self.models.discard(key)
        self.holding.unloading.add(key)

    def loaded(self, key: str, nbytes: int, footprint: Footprint | None, now: float) -> float | None:
        """A run-time load finished; returns when it was sent (None: not asked of this life)."""
        started = self.holding.loading.pop(key, None)
        self.under_way.pop(key, None)
        self.models.add(key)
        self.sizes[key] = nbytes
        if footprint is not None:
            self.footprints[key] = footprint
        self.holding.used_at[key] = now
        return started

    def load_failed(self, key: str) -> float | None:
        """A run-time load failed; returns when it was sent (None: not asked of this life)."""
        started = self.holding.loading.pop(key, None)
        self.under_way.pop(key, None)
        self.holding.wanted.discard(key)
        return started

    def unloaded(self, key: str) -> int:
        """An unload finished; returns the parameter bytes it freed."""
        self.holding.unloading.discard(key)
        freed = self.sizes.pop(key, 0)
        self.footprints.pop(key, None)
        self.holding.used_at.pop(key, None)
        self.holding.unloads += 1
        return freed

    # ---- a generator's sequences (broker/generate/streams.py) ---------------------------------

    def slots_known(self, key: str, slots: int) -> None:
        """Its pool of `key` holds this many sequences (its load's ModelLoaded, each Steps)."""
        self.slots[key] = slots

    def sequences_taken(self, key: str, n: int) -> None:
        """n sequences of `key` went to it (an admission batch)."""
        self.sequences[key] = self.sequences.get(key, 0) + n

    def sequence_freed(self, key: str) -> None:
        """One of them ended (or was never started): its slot is free."""
        n = self.sequences.get(key, 0) - 1
        if n > 0:
            self.sequences[key] = n
        else:
            self.sequences.pop(key, None)

    # ---- batches (the core) -------------------------------------------------------------------

    def batch_sent(self, batch_id: int, done_by: float, now: float) -> None:
        """A staged batch went to it: predicted done by `done_by`; its version was used now (LRU)."""
        self.free_at = done_by
        self.holding.used_at[self.inflight[batch_id].key] = now

    def busy_until(self, done_by: float) -> None:
        """When the batches it holds are predicted to be done (the cost model's, at a completion)."""
        self.free_at = done_by

    def release_later(self, block: int) -> None:
        """An output block replied from: freed with the next message to the worker."""
        self.releases.append(block)

    def _use_ring(self, segment: Segment) -> None:
        self.segment = segment
        self.inputs = RingAllocator(self.input_bytes)
        self.releases: list[int] = []  # output blocks replied from, not yet told to the worker
        self.holding = Holding()              # run-time loads and unloads (models/placement.py)
        self.sizes: dict[str, int] = {}       # key -> parameter and buffer bytes of what it loaded
        self.footprints: dict[str, Footprint] = {}   # key -> its memory as measured there (docs/MEMORY.md)

    def take_releases(self) -> list[int]:
        out, self.releases = self.releases, []
        return out

    @property
    def identity(self) -> bytes:
        return f"w{self.worker_id}.{self.generation}".encode()

    @property
    def loader_identity(self) -> bytes:
        """The socket of the worker's loader thread (runtime loads and unloads)."""
        return self.identity + b"~load"

    def holds(self, key: str) -> bool:
        """Whether it has a batch of this version in flight, or a generator's sequence running."""
        return key in self.sequences or any(b.key == key for b in self.inflight.values())

    @property
    def control_identity(self) -> bytes:
        """The socket of the worker's heartbeat thread (zmq sockets are one thread's each)."""
        return self.identity + b"~ctl"

    @property
    def name(self) -> str:
        return f"worker{self.worker_id}[{self.device}]"

    def can_take(self, model_key: str, max_inflight: int, suspect: bool = False, head: Pending | None = None) -> bool:
        """Room for a batch of this version; a suspect batch (a retry after a death) runs on a
        worker holding nothing else, so if it kills the worker it takes no other request along.
        A request bound to a GPU (`head`'s CUDA tensors) runs only on a worker on that GPU."""
        if not self.offers(model_key) or self.retiring or \
                (self.holding.evicting and model_key in self.holding.evicting) or \
                (head is not None and not gpu_fits(self, head)):
            return False
        if suspect or (head is not None and is_shadow(head.client)):   # a copy waits for an idle worker
            return not self.inflight
        return len(self.inflight) < max_inflight and not any(b.suspect for b in self.inflight.values())

    def stage(self, batch_id: int, requests: list[Pending], inputs: list[IOSpec]) -> Batch | None:
        """Copy the batch's inputs into the input arena; None while the arena has no room."""
        sizes = [sum(p.nbytes[k] for p in requests) for k in range(len(inputs))]
        block = self.inputs.alloc(aligned_total(sizes))
        if block is None:
            return None
        buf = self.segment.buf
        rows = sum(p.rows for p in requests)
        tensors = []
        dims = plain_dims(requests[0].shape_key)   # without a GPU tag
        for k, (decl, rel) in enumerate(zip(inputs, region_offsets(sizes))):
            offset = pos = block + rel
            for p in requests:            # rows of one input lie contiguous: the worker's view is no gather
                n = p.nbytes[k]
                buf[pos:pos + n] = p.tensors[k]
                pos += n
            shape = [rows, *dims[k]] if dims else [rows, *decl.shape]
            tensors.append(BlockTensor(name=decl.name, dtype=decl.dtype, shape=shape, offset=offset,
                                       nbytes=sizes[k]))
        first = requests[0]
        self.inflight[batch_id] = Inflight(batch_id, first.model, model_key(first.model, first.version), requests,
                                           block, rows)
        traces = [p.trace for p in requests]   # the callers' trace contexts, for the worker's batch span
        batch = Batch(batch_id=batch_id, model=requests[0].model, version=requests[0].version, rows=rows,
                      block=block, inputs=tensors, deadline=max(p.deadline for p in requests),
                      release=self.take_releases(), splits=[p.rows for p in requests],
                      traces=[t or "" for t in traces] if any(traces) else [], ids=[p.req_id for p in requests])
        if first.generate is not None:   # a generator's admission batch: each request as a sequence
            batch.sequences = [p.generate for p in requests]
        return attach_cuda(batch, requests)   # CUDA inputs: descriptors, no ring bytes (nbytes 0)

    def withdraw(self, wanted) -> tuple[list[Pending], list[Withdraw]]:
        """Take the requests `wanted(p)` picks out of the batches in flight: (those requests, the
        Withdraw messages asking the worker to leave them out of batches it may not have launched)."""
        taken, asks = [], []
        for batch in self.inflight.values():
            hits, ask = take_out(batch, wanted)
            taken += hits
            if ask is not None:
                asks.append(ask)
        return taken, asks

    def withdrawn_in_flight(self) -> list[Gone]:
        """The withdrawn requests still holding places in batches in flight (the worker died)."""
        return [e for batch in self.inflight.values() for e in batch.order if type(e) is Gone]

    def finish(self, done: Done) -> Inflight | None:
        """Take the batch a completion answers out of flight and release its input block."""
        batch = self.inflight.pop(done.batch_id, None)
        if batch is not None:
            self.inputs.release(batch.block)
        return batch

    def take_part(self, done: Done) -> tuple[Inflight | None, list, list]:
        """The batch a completion answers (None: unknown), the places it answers (requests, and
        Gone for withdrawn ones whose rows it carries), taken out of that batch, and the places
        the worker left out (Done.withdrawn, on its first completion of the batch); the final
        part (a whole batch's completion is one) takes the batch out of flight too."""
        batch = self.inflight.get(done.batch_id)
        if batch is None:
            return None, [], []
        dropped = left_out(batch, done.withdrawn) if done.withdrawn and not batch.reported else []
        lo = done.first - batch.answered
        hi = lo + done.count if done.count else len(batch.order)
        part = batch.order[lo:hi]
        del batch.order[lo:hi]  # answered now: a later worker death must not retry them
        batch.answered += len(part)
        live = [p for p in part if type(p) is not Gone]
        if live:
            drop_from(batch.requests, live)
        for p in live:
            p.compute_us = done.compute_us
        if done.final:
            self.finish(done)
        return batch, part, dropped

    def output_rows(self, done: Done, batch: Inflight, requests: list | None = None):
        """Yield (request, {output name: memoryview of its rows}) for each place the completion
        answers: those given (a part's), else every place of the batch (a withdrawn one, Gone,
        too: its rows are skipped by the caller). A bytes output's rows have no fixed size: its
        `cuts` say where each begins."""
        buf = self.segment.buf
        requests = batch.order if requests is None else requests
        rows = sum(p.rows for p in requests)
        row = 0
        for p in requests:
            views = {}
            for t in done.outputs:
                if t.dtype == BYTES:
                    start, end = t.offset + t.cuts[row], t.offset + t.cuts[row + p.rows]
                else:
                    per_row = t.nbytes // rows
                    start = t.offset + row * per_row
                    end = start + p.rows * per_row
                views[t.name] = (t, buf[start:end])
            yield p, views
            row += p.rows
