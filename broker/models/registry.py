"""The models the broker serves: the one owner of the models and their versions' records.

Every write of a model or of a version's state, weight or place in its model goes through a
method here, which guards the version's edge (state/versions.py _NEXT), checks the whole
write before it makes any of it (a refused write changes nothing), rebuilds the model's
traffic split and bumps `generation`, so what is memoised on the models (admission's header
checks) is dropped by keying on it. The checks of requests live in checks.py. Not routing, so
not here: a record's load figures (placement's), `active` (admission's), and `seen` as a
worker's ready message marks it (the handshake's). A version that stops serving (drained,
forgotten) or a model removed loses its response cache's answers here, at once.
"""
from __future__ import annotations

from typing import Iterable

from tgw.shm.errors import Code, fail
from tgw.shm.wire import Infer, ModelSpec, split_model_key

from tgw.broker.config.load import ModelDecl
from tgw.broker.config.schema import VersionDecl
from tgw.broker.state.versions import IllegalVersionTransition, VersionRecord, VersionState
from . import checks
from .checks import Checked, Shape
from .entry import FULL_WEIGHT, ModelEntry

__all__ = ["FULL_WEIGHT", "Checked", "IllegalVersionTransition", "ModelEntry", "Registry", "Shape"]


class Registry:
    def __init__(self, models: list[ModelDecl]):
        """`models`: the config's models section."""
        self.models: dict[str, ModelEntry] = {m.name: ModelEntry(m) for m in models}
        self.generation = 0    # bumped by every write below: memos keyed on it go

    # ---- reads -------------------------------------------------------------------------------

    def startup_specs(self) -> list[ModelSpec]:
        """What a starting worker loads: every version of an always-resident model that is loading,
        ready or draining (on-demand ones load when asked for)."""
        return [m.spec(r) for m in self.models.values() if not m.on_demand for r in m.records.values()]

    def record(self, key: str) -> VersionRecord | None:
        if ":" not in key:   # e.g. "<preload>" in a worker's failure
            return None
        name, version = split_model_key(key)
        m = self.models.get(name)
        return m.records.get(version) if m is not None else None

    def entry(self, name: str) -> ModelEntry:
        model = self.models.get(name)
        if model is None or model.removed:
            raise fail(Code.MODEL_NOT_FOUND, f"no model named {name!r}", model=name,
                       available=sorted(n for n, m in self.models.items() if not m.removed))
        return model

    def validate(self, req: Infer, frame_sizes: list[int]) -> Checked:
        entry = self.entry(req.model)
        rec = self.route(entry, req)
        return Checked(entry, rec, self.check_shapes(entry, req, frame_sizes))

    route = staticmethod(checks.route)
    check_shapes = staticmethod(checks.check_shapes)

    # ---- writes: models ----------------------------------------------------------------------

    def declare(self, decl: ModelDecl) -> ModelEntry:
        """A model new at run time (a reload): no versions until they are added and flipped to."""
        if decl.name in self.models:
            raise IllegalVersionTransition(f"model {decl.name!r} is declared already")
        entry = self.models[decl.name] = ModelEntry(decl, versions=False)
        self._changed()
        return entry

    def redeclare(self, decl: ModelDecl) -> None:
        """A served model's new declaration (a reload checked that only hot keys differ); a changed
        cache section starts its response cache afresh."""
        entry = self._model(decl.name)
        if decl.cache != entry.decl.cache:
            entry.recache(decl.cache)
        entry.decl = decl
        entry.relabel()   # a label file edited since is read again
        self._changed()

    def remove(self, name: str) -> list[VersionRecord]:
        """Dropped from the config: refused from now on, kept until its versions are retired and
        it is forgotten. Returns its versions."""
        entry = self._model(name)
        entry.removed = True
        _uncache(entry)
        self._changed()
        return list(entry.records.values())

    def forget(self, name: str, versions: Iterable[str] | None = None) -> None:
        """Take these versions (any state; None: the whole model) out. What is gone already
        (dropped meanwhile by a worker's failed reload) is no error."""
        entry = self.models.get(name)
        if entry is None:
            return
        if versions is None:
            del self.models[name]
        else:
            versions = list(versions)
            for v in versions:
                entry.records.pop(v, None)
        _uncache(entry, versions)
        self._changed(entry)

    # ---- writes: versions --------------------------------------------------------------------

    def add_version(self, name: str, decl: VersionDecl) -> VersionRecord:
        """A version loading at run time: LOADING, so no request may name it until a flip."""
        entry = self._model(name)
        if decl.version in entry.records:
            raise IllegalVersionTransition(f"{name}:{decl.version} exists already "
                                           f"({entry.records[decl.version].state.value})")
        rec = entry.records[decl.version] = VersionRecord(name, decl, VersionState.LOADING, entry.on_demand)
        self._changed(entry)
        return rec

    def flip(self, name: str, weights: dict[str, int], drain: Iterable[str] | None = None) -> list[VersionRecord]:
        """In one step: the named versions (loading or ready) become ready with these weights,
        the other ready ones weight 0, and the versions in `drain` drain (those already
        draining stay so). `drain` None: a swap (a single version named) drains the ready
        versions that had weight, anything else drains none. Returns the versions it drained."""
        entry = self._model(name)
        recs = entry.records
        for v in weights:   # all checked first: a refused flip changes nothing
            if v not in recs:
                raise IllegalVersionTransition(f"flip of {name}: it has no version {v!r} (versions: {list(recs)})")
            if recs[v].state is not VersionState.READY:
                recs[v].check(VersionState.READY)
        if drain is None:
            swap = len(weights) == 1
            drain = [v for v, r in recs.items() if swap and r.state is VersionState.READY and r.weight > 0]
        drained = [recs[v] for v in self._to_drain(entry, [v for v in drain if v not in weights])]
        for v, w in weights.items():
            recs[v].ready(w)
        for r in recs.values():
            if r.version not in weights and r.state is VersionState.READY:
                r.weight = 0
        for r in drained:
            r.drain()
        _uncache(entry, [r.version for r in drained])
        self._changed(entry)
        return drained

    def mark_shadow(self, name: str, version: str, shadow: bool) -> None:
        """A shadow version answers nobody (checks.route refuses naming it); promoted, it is not one."""
        self._model(name).records[version].shadow = shadow
        self._changed()

    def retire(self, name: str, records: Iterable[VersionRecord]) -> list[VersionRecord]:
        """Drain these versions: what was admitted for them finishes, nothing new is. Those
        draining already stay so, those forgotten meanwhile are left out. Returns the records."""
        entry = self._model(name)
        records = list(records)
        for r in records:
            if r.model != name:
                raise IllegalVersionTransition(f"retire of {name}: {r.key} is another model's version")
        mine = [r.version for r in records if entry.records.get(r.version) is r]
        for v in self._to_drain(entry, mine):
            entry.records[v].drain()
        _uncache(entry, mine)
        self._changed(entry)
        return records

    def weigh(self, name: str, weights: dict[str, int]) -> None:
        """The traffic split: each ready version the weight given, 0 if none is."""
        entry = self._model(name)
        ready = entry.routable()
        wrong = [v for v in weights if v not in ready]
        if wrong:
            raise IllegalVersionTransition(f"weights for {name}: {wrong} not ready (ready: {ready})")
        for v in ready:
            entry.records[v].weight = weights.get(v, 0)
        self._changed(entry)

    # ---- inside ------------------------------------------------------------------------------

    def _model(self, name: str) -> ModelEntry:
        entry = self.models.get(name)
        if entry is None:
            raise IllegalVersionTransition(f"no model {name!r} is declared")
        return entry

    @staticmethod
    def _to_drain(entry: ModelEntry, versions: Iterable[str]) -> list[str]:
        """The versions to drain now, each edge checked before any is taken."""
        out = []
        for v in versions:
            r = entry.records.get(v)
            if r is None:
                raise IllegalVersionTransition(f"{entry.name} has no version {v!r} to drain")
            if r.state is not VersionState.DRAINING:
                r.check(VersionState.DRAINING)
                out.append(v)
        return out

    def _changed(self, entry: ModelEntry | None = None) -> None:
        if entry is not None:
            entry.retraffic()
        self.generation += 1


def _uncache(entry: ModelEntry, versions: list[str] | None = None) -> None:
    """Versions that serve no more (None: every one) lose their kept answers at once."""
    if entry.cache is None or versions == []:
        return
    if versions is None:
        entry.cache.clear()
    else:
        entry.cache.drop(versions)
