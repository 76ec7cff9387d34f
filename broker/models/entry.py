"""One declared model as the broker serves it: its declaration, its versions' records, the split
that picks which version serves a request naming none (Traffic), its response cache.

Read by everything that serves; written only by the registry (registry.py), which rebuilds
the traffic split after each write.

The split: the versions' weights lay out adjacent intervals of [0, 1) in version order. A
request with a routing key lands at a stable hash of the key, so one key always gets the same
version while the weights are unchanged, with no per-key state; when weights move, only the keys
in the intervals that moved change version. A request without a key lands at the next point of
the golden-ratio sequence (n * 0.618... mod 1), which visits [0, 1) evenly: over any run of n
requests each version's share is within a few / n of its weight, not just on average.
"""
from __future__ import annotations

import bisect
import hashlib

from tgw.shm.wire import BYTES, ControlSpec, GeneratorSpec, ImplicitStateSpec, IOSpec, ModelInfo, ModelSpec, \
    SequenceSpec, StateSpec, nbytes_of

from tgw.broker.cache.responses import ResponseCache
from tgw.broker.config.load import ModelDecl
from tgw.broker.config.schema import CacheDecl
from tgw.broker.config.labels import read_labels
from tgw.broker.state.versions import VersionRecord, VersionState

FULL_WEIGHT = 100   # a version that takes every unnamed request shows weight 100 (100 %)
GOLDEN = 0.6180339887498949
HASH_SCALE = float(1 << 64)


class ModelEntry:
    """One declared model: its declaration, its versions' records and the traffic split."""

    def __init__(self, decl: ModelDecl, versions: bool = True):
        """`versions`: its declared versions start ready (the config at start); else it has none
        until the registry adds them (a model a reload declares loads them first)."""
        self.decl = decl
        self.inputs = [_io(t) for t in decl.inputs]
        self.outputs = [_io(t) for t in decl.outputs]
        self.input_index = {t.name: i for i, t in enumerate(decl.inputs)}
        self.output_names = frozenset(t.name for t in decl.outputs)
        self.variable = any(d == -1 for t in decl.inputs for d in t.shape)  # batch only equal shapes
        self.has_bytes_inputs = any(t.dtype == BYTES for t in decl.inputs)  # sized by their frames
        self.on_demand = decl.residency == "on_demand"
        self.labels: dict[str, list[str]] = {}
        self.relabel()
        self.removed = False     # dropped from the config: refused, kept until its queue drains
        self.records: dict[str, VersionRecord] = {}
        weights = decl.weights()
        for v in decl.versions if versions else ():
            self.records[v.version] = VersionRecord(decl.name, v, VersionState.READY, self.on_demand,
                                                    weight=weights.get(v.version, 0))
        self.traffic = Traffic({})
        self.retraffic()
        self.cache: ResponseCache | None = None   # its response cache (models[].cache); None: off
        self.recache(decl.cache)

    @property
    def name(self) -> str:
        return self.decl.name

    def relabel(self) -> None:
        """Its outputs' class labels for the classification extension, read anew (config/labels.py):
        at start and at each reload (whose config check found the files readable)."""
        self.labels = {t.name: read_labels(t.labels) for t in self.decl.outputs if t.labels}

    @property
    def default(self) -> str | None:
        """The version with the greatest weight (ties: the later one); None while none has weight."""
        best = None
        for rec in self.records.values():
            if rec.weight > 0 and rec.state is VersionState.READY and (best is None or rec.weight >= best.weight):
                best = rec
        return best.version if best else None

    def routable(self) -> list[str]:
        return [v for v, r in self.records.items() if r.state is VersionState.READY]

    def retraffic(self) -> None:
        """Rebuild the split from the READY versions' weights (in version order); if none of
        them keeps a weight, the newest takes the requests that name no version. The
        registry's, after each of its writes."""
        ready = [r for r in self.records.values() if r.state is VersionState.READY]
        if ready and not any(r.weight for r in ready):
            ready[-1].weight = FULL_WEIGHT
        self.traffic = Traffic({v: r.weight for v, r in self.records.items() if r.state is VersionState.READY})

    def recache(self, decl: CacheDecl | None) -> None:
        """A response cache as declared, empty (the registry's, when the declaration changes it)."""
        if self.cache is not None:
            self.cache.clear()   # its answers go now; a computed answer still due stores nothing
        self.cache = ResponseCache(decl) if decl is not None else None

    def output_bytes(self, rows: int) -> list[int] | None:
        """Bytes of each declared output (the worker writes them all) for `rows` rows; None when
        some output dim is -1 or some output is bytes, so the size is known only after compute."""
        if any(t.dtype == BYTES or -1 in t.shape for t in self.outputs):
            return None
        return [nbytes_of(t.dtype, [rows, *t.shape]) for t in self.outputs]

    def spec(self, rec: VersionRecord) -> ModelSpec:
        stage = self.decl.is_stage   # a stage's worker also needs its device, options and warm-up inputs
        spec = rec.spec(self.inputs, self.outputs, self.decl.warmup_batch_sizes, self.decl.max_rows,
                        device=(self.decl.device or "cpu") if stage else "", options=self.decl.options if stage else None)
        spec.batched = self.decl.batched
        spec.warmup_inputs = list(self.decl.warmup_inputs) if stage else []
        spec.generator = generator_spec(self.decl.generator) if self.decl.generator is not None else None
        sb = self.decl.sequence_batching
        spec.sequence = sequence_spec(sb) if sb is not None else None
        return spec

    @property
    def is_generator(self) -> bool:
        return self.decl.generator is not None

    @property
    def is_sequence(self) -> bool:
        """A sequence model (docs/SEQUENCES.md): its callers step its sequences."""
        return self.decl.sequence_batching is not None

    def info(self, ready: bool) -> ModelInfo:
        return ModelInfo(name=self.name, versions=self.routable(), default_version=self.default or "",
                         max_batch_size=self.decl.max_batch_size, inputs=self.inputs, outputs=self.outputs,
                         ready=ready, wire_dtypes=list(self.decl.wire_dtypes))


def generator_spec(g) -> GeneratorSpec:
    """What a generator's worker is told of its `generator:` declaration."""
    return GeneratorSpec(state=[StateSpec(name=t.name, dtype=t.dtype, shape=list(t.shape)) for t in g.state],
                         max_sequences=g.max_sequences or 0,
                         state_memory=int((g.state_memory_mb or 0) * (1 << 20)), max_length=g.max_length or 0,
                         length_input=g.length_input or "", max_outputs=g.max_outputs,
                         max_prefill_rows=g.max_prefill_rows, end_tokens=list(g.end_tokens))


def sequence_spec(sb) -> SequenceSpec:
    """What a sequence model's worker is told of its `sequence_batching:` declaration."""
    return SequenceSpec(state=[ImplicitStateSpec(name=t.name, dtype=t.dtype, shape=list(t.shape),
                                                 output=t.output or "", initial=t.initial) for t in sb.state],
                        controls=[ControlSpec(kind=c.kind, name=c.name, dtype=c.dtype) for c in sb.control_inputs],
                        max_sequences=sb.max_sequences or 0, state_memory=int((sb.state_memory_mb or 0) * (1 << 20)))


def _io(t) -> IOSpec:
    return IOSpec(name=t.name, dtype=t.dtype, shape=list(t.shape),
                  reshape=None if t.reshape is None else list(t.reshape))


class Traffic:
    def __init__(self, weights: dict[str, int]):
        """`weights`: version -> weight >= 0, in the order their intervals are laid out; the sum
        must be positive (callers validate; an empty dict routes nothing)."""
        self.weights = {v: w for v, w in weights.items() if w > 0}
        total = sum(self.weights.values())
        self.versions = list(self.weights)
        self.edges: list[float] = []   # the upper end of each version's interval
        acc = 0
        for w in self.weights.values():
            acc += w
            self.edges.append(acc / total)
        self._n = 0

    def __bool__(self) -> bool:
        return bool(self.versions)

    def share(self, version: str) -> float:
        total = sum(self.weights.values())
        return self.weights.get(version, 0) / total if total else 0.0

    def pick(self, routing_key: str | None = None) -> str | None:
        """The version for one request; None when no version has weight."""
        versions = self.versions
        if len(versions) <= 1:
            return versions[0] if versions else None
        if routing_key is None:
            self._n += 1
            point = (self._n * GOLDEN) % 1.0
        else:
            digest = hashlib.blake2b(routing_key.encode(), digest_size=8).digest()
            point = int.from_bytes(digest, "little") / HASH_SCALE
        return versions[min(bisect.bisect_right(self.edges, point), len(versions) - 1)]
