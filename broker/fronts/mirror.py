"""A front process's copy of the registry (the hub's Directory), read as the faces' infer paths
read the broker's: `entry(name)` and `view.pipelines.table` / `view.models`.

The faces' inference paths read little of the registry: a model's declaration (its inputs,
batch dim, generator), its versions (a numeric alias is turned into a version's name), its
default version, its output labels (classification), and a pipeline's inputs, batch size and
version. The hub sends that as plain data (wire.FrontModel, FrontPipeline); each entry here is
built once per Directory, not per request. `entry` refuses an unknown model with the registry's
own error (code and words), so a front answers as the broker does; a model this copy lacks may
have been loaded a moment ago, so the request handlers call `known` first and, on a miss, `fresh`
(one DIRECTORY asked of the hub, awaited, shared by every miss meanwhile).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable, NamedTuple

from tgw.shm.errors import Code, fail
from tgw.shm.wire import IOSpec

from tgw.broker.config.load import ModelDecl
from tgw.broker.models.entry import ModelEntry
from tgw.broker.protocol.triton_docs import version_named

from .wire import Directory, FrontModel, FrontPipeline

log = logging.getLogger("tgw.broker")
FRESH_TIMEOUT_S = 2.0   # a hub that does not answer an ask in this long: the copy as it is answers


class MirroredEntry(ModelEntry):
    """A ModelEntry whose versions are names only: the records' states and weights stay in the
    broker, which routes; `default` is the broker's, as sent."""

    def __init__(self, decl: ModelDecl, versions: list[str], default: str | None):
        super().__init__(decl, versions=False)
        self.records = dict.fromkeys(versions)   # version -> None: the faces read only the names
        self._default = default

    def relabel(self) -> None:
        try:   # the broker read these files; one unreadable here costs only the labels' text
            super().relabel()
        except Exception as exc:
            log.warning("front: model %r: its output labels are unreadable here (%s)", self.decl.name, exc)
            self.labels = {}

    @property
    def default(self) -> str | None:
        return self._default

    def routable(self) -> list[str]:
        return list(self.records)


class Source(NamedTuple):
    step: str
    name: str


class Step(NamedTuple):
    name: str
    model: str


class MirroredPlan:
    """What the faces read of a pipeline: its inputs, batch size and version, and for the
    labels of classification which model output each of its outputs is (one step per model)."""
    __slots__ = ("name", "inputs", "max_batch_size", "version", "steps", "output_sources")

    def __init__(self, name: str, p: FrontPipeline):
        self.name, self.max_batch_size, self.version = name, p.max_batch_size, p.version
        self.steps = [Step(m, m) for m in {model for model, _ in p.sources.values()}]
        self.output_sources = {out: Source(model, made) for out, (model, made) in p.sources.items()}
        self.inputs = [IOSpec(name=t["name"], dtype=t["dtype"], shape=list(t["shape"]),
                              reshape=None if t.get("reshape") is None else list(t["reshape"])) for t in p.inputs]


class Pipelines:
    __slots__ = ("table",)

    def __init__(self):
        self.table: dict[str, MirroredPlan] = {}


class View:
    """The part of BrokerView the infer paths read."""
    __slots__ = ("models", "pipelines")

    def __init__(self):
        self.models: dict[str, MirroredEntry] = {}
        self.pipelines = Pipelines()


class Mirror:
    def __init__(self, ask: Callable[[], None]):
        """`ask`: send the hub a DIRECTORY request (its answer comes to `apply`)."""
        self.ask = ask
        self.view = View()
        self.generation = -1       # none applied yet
        self.load_header: str | None = None
        self.waiting: asyncio.Future | None = None   # an ask in flight: every miss awaits this one
        self.first = asyncio.get_running_loop().create_future()   # the first directory applied

    def apply(self, d: Directory) -> None:
        """A directory from the hub: entries rebuilt for the models whose data changed."""
        self.load_header = d.load_header
        if d.generation != self.generation:
            old = self.view.models
            models = {}
            for name, m in d.models.items():
                kept = old.get(name)
                try:
                    models[name] = kept if kept is not None and same(kept, m) else built(name, m)
                except Exception:   # a declaration this process cannot read: the broker answers for it
                    log.exception("front: model %r from the directory is unreadable here", name)
            self.view.models = models
            self.view.pipelines.table = {name: MirroredPlan(name, p) for name, p in d.pipelines.items()}
            self.generation = d.generation
        if self.waiting is not None and not self.waiting.done():
            self.waiting.set_result(None)
        self.waiting = None
        if not self.first.done():
            self.first.set_result(None)

    def entry(self, name: str) -> MirroredEntry:
        """The model of that name, refused as the registry refuses it (Registry.entry)."""
        model = self.view.models.get(name)
        if model is None:
            raise fail(Code.MODEL_NOT_FOUND, f"no model named {name!r}", model=name,
                       available=sorted(self.view.models))
        return model

    def known(self, model: str, version: str | None = None) -> bool:
        """This copy can answer for `model` (and `version`: a name or a numeric alias it has)."""
        if model in self.view.pipelines.table:
            return True
        entry = self.view.models.get(model)
        if entry is None:
            return False
        return version is None or version in entry.records or version_named(entry.records, version) != version

    async def fresh(self) -> None:
        """The hub's directory as of now (at most FRESH_TIMEOUT_S waited; then this copy stands)."""
        if self.waiting is None:
            self.waiting = asyncio.get_running_loop().create_future()
            self.ask()
        try:
            await asyncio.wait_for(asyncio.shield(self.waiting), FRESH_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("front: the hub did not send its directory within %.1f s", FRESH_TIMEOUT_S)
            self.waiting = None


def same(entry: MirroredEntry, m: FrontModel) -> bool:
    return entry.decl_data == m.decl and list(entry.records) == m.versions and entry.default == m.default


def built(name: str, m: FrontModel) -> MirroredEntry:
    entry = MirroredEntry(ModelDecl.model_validate(m.decl), m.versions, m.default)
    entry.decl_data = m.decl   # what it was built from: the next directory's same data keeps it
    return entry
