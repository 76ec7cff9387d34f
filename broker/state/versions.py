"""One version of a model as the broker tracks it over its life: loading, ready, draining.

The record is what routing, admission and the rollouts share: its state decides whether a
request may name it, `active` counts the requests admitted for it and not yet answered (a
draining version is unloaded once that reaches 0), and the load figures feed status,
metadata and the residency budget. Its state moves only along _NEXT, through `ready` and
`drain`, which only the models' registry (models/registry.py) calls.
"""
from __future__ import annotations

import os
from dataclasses import InitVar, dataclass
from enum import Enum

from tgw.shm.wire import Footprint, IOSpec, ModelSpec, VersionInfo, as_builtins, model_key

from tgw.broker.config.schema import VersionDecl
from .pool import IllegalTransition


class VersionState(str, Enum):
    LOADING = "loading"     # loading at run time: not routable until the rollout flips to it
    READY = "ready"         # routable (an on-demand version: loadable, resident or not)
    DRAINING = "draining"   # being unloaded: what was admitted finishes, nothing new is


_NEXT = {
    # LOADING -> DRAINING: a loading version unloaded before routing ever saw it drains harmlessly
    VersionState.LOADING: {VersionState.READY, VersionState.DRAINING},
    VersionState.READY: {VersionState.DRAINING},
    VersionState.DRAINING: set(),   # the end: the registry forgets it once drained
}


class IllegalVersionTransition(IllegalTransition):
    """A broker bug: a version (or model) written along an edge its life cycle does not have."""


@dataclass(eq=False)
class VersionRecord:
    """`state` (the third argument: where its life starts) changes only through ready/drain."""
    model: str
    decl: VersionDecl
    initial: InitVar[VersionState]
    on_demand: bool = False
    weight: int = 0            # share of the requests that name no version (of the model's sum)
    seen: bool = False         # some worker has had it loaded: admitted while a worker restarts
    active: int = 0            # admitted, not yet answered
    bytes: int = 0             # parameter and buffer bytes, measured at its first load
    footprint: Footprint | None = None   # its memory as last measured at a load (weights + activation peak)
    loads: int = 0
    evictions: int = 0
    last_load_ms: float | None = None   # its last run-time load's time; None: never loaded at run time
    error: str = ""            # why its last load failed ...
    failed_at: float = 0.0     # ... and when (an on-demand load is not retried for a while)
    shadow: bool = False       # answers nobody: only copies of others' requests (canary/shadow.py)

    def __post_init__(self, initial: VersionState) -> None:
        self._state = initial
        self.key = model_key(self.model, self.decl.version)

    @property
    def state(self) -> VersionState:
        return self._state

    def check(self, to: VersionState) -> None:
        """Raise unless `to` is an edge from here (the registry checks a whole write first)."""
        if to not in _NEXT[self._state]:
            raise IllegalVersionTransition(f"{self.key}: {self._state.value} -> {to.value}")

    def ready(self, weight: int) -> None:
        """Routable with this weight (ready already: only the weight changes)."""
        if self._state is not VersionState.READY:
            self.check(VersionState.READY)
            self._state = VersionState.READY
        self.seen, self.weight = True, weight

    def drain(self) -> None:
        self.check(VersionState.DRAINING)
        self._state, self.weight = VersionState.DRAINING, 0

    # the figures below change only through these methods, each called by the one owner named
    def admitted(self) -> None:
        """A request for it was admitted (admission)."""
        self.active += 1

    def left(self) -> bool:
        """An admitted request left (admission): whether that ended its drain."""
        self.active -= 1
        return not self.active and self._state is VersionState.DRAINING

    def served_by(self, nbytes: int, footprint: Footprint | None = None) -> None:
        """A worker reported it loaded at start-up (the handshake): admitted while workers restart."""
        self.seen, self.bytes = True, self.bytes or nbytes
        self.footprint = footprint or self.footprint

    def loaded(self, nbytes: int, load_ms: float, footprint: Footprint | None = None) -> None:
        """A runtime load finished (placement)."""
        self.bytes, self.loads, self.last_load_ms, self.error = nbytes, self.loads + 1, load_ms, ""
        self.footprint = footprint or self.footprint

    def load_failed(self, why: str, at: float) -> None:
        """A runtime load failed (placement): not retried on demand for a while."""
        self.error, self.failed_at = why, at

    def evicted(self) -> None:
        """Unloaded to make room (residency)."""
        self.evictions += 1

    @property
    def version(self) -> str:
        return self.decl.version

    @property
    def format(self) -> str:
        """What its file holds (parse_config and rollout.checked_decl read it from the file)."""
        return self.decl.format or "torchscript"

    def size(self) -> int:
        """Bytes it takes loaded (what residency counts): its measured footprint, else param_bytes."""
        if self.footprint is not None and self.footprint.measured_on:
            return self.footprint.total
        return self.param_bytes()

    def param_bytes(self) -> int:
        """Parameter and buffer bytes as measured, else the file's size (weights dominate a
        TorchScript file); a stage's is what its worker measured (0 unless it reports some)."""
        if self.bytes or self.decl.path is None:
            return self.bytes
        try:
            return os.path.getsize(self.decl.path)
        except OSError:
            return 0

    @property
    def source(self) -> str:
        """Where it comes from: its model file, or a stage's handler ("/file.py:Class", "module:Class")."""
        return self.decl.path if self.decl.path is not None else self.decl.handler or ""

    def spec(self, inputs: list[IOSpec], outputs: list[IOSpec], warmup: list[int], max_batch_size: int,
             device: str = "", options: dict | None = None) -> ModelSpec:
        """What a worker loads; a stage's also says its `device` (cpu or cuda) and `options`."""
        return ModelSpec(name=self.model, version=self.version, path=self.decl.path or "", inputs=inputs,
                         outputs=outputs, warmup_batch_sizes=list(warmup), sha256=self.decl.sha256,
                         format=self.format, max_batch_size=max_batch_size, handler=self.decl.handler or "",
                         device=device, options=dict(options or {}))

    def info(self, workers: dict[str, str]) -> VersionInfo:
        return VersionInfo(version=self.version, path=self.source, state=self.state.value, weight=self.weight,
                           sha256=self.decl.sha256, workers=workers, bytes=self.param_bytes(), loads=self.loads,
                           evictions=self.evictions,
                           # the wire says 0.0 for never loaded at run time
                           last_load_ms=0.0 if self.last_load_ms is None else round(self.last_load_ms, 3),
                           format=self.format, footprint=as_builtins(self.footprint) if self.footprint else {})
