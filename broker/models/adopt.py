"""Models added and removed while serving, by name and version, as TorchServe's management API
does (register, unregister, set default; broker/torchserve/): a stage declaration made from an
archive is declared, its version loaded and made routable; a reload keeps what was added.

Run by the operator in turn with its other ops (operator.py), through the rollout's loads and
drains, so a registration is loaded, warmed and answered exactly as `models load` is.
"""
from __future__ import annotations

from tgw.shm.errors import Code, fail

from tgw.broker.config.load import ModelDecl
from .entry import FULL_WEIGHT
from .reload import Reloader
from .rollout import Rollout


class Adoption:
    def __init__(self, rollout: Rollout, reloader: Reloader):
        self.rollout, self.reloader = rollout, reloader
        self.registry = rollout.registry

    async def add(self, decl: ModelDecl, root: str) -> str:
        """Serve `decl`'s (last) version: a new model takes every request that names no version;
        a new version of a served model is routable by name and leaves the default as it was."""
        version = decl.versions[-1]
        entry = self.registry.models.get(decl.name)
        new = entry is None
        if new:
            entry = self.registry.declare(decl)
            self.reloader.d.declare(decl)
        elif version.version in entry.records:
            raise fail(Code.INVALID_ARGUMENT, f"Model version {version.version} is already registered for model "
                       f"{decl.name}", model=decl.name, version=version.version, reason="exists")
        try:
            checked = await self.rollout.checked_decl(entry, version.version, None, version.sha256,
                                                      version.format, version.handler)
            rec = await self.rollout.load_beside(entry, checked)
        except BaseException:
            if new:
                self.registry.forget(decl.name)
            raise
        weights = {r.version: r.weight for r in entry.records.values() if r.weight > 0}
        self.registry.flip(entry.name, {**weights, rec.version: FULL_WEIGHT if new else 0}, drain=[])
        known = [] if new else [v for v in entry.decl.versions if v.version != version.version]
        self.declared(decl.model_copy(update={"versions": [*known, version]}), root)
        return f"{rec.key} loaded"

    def declared(self, decl: ModelDecl, root: str = "") -> None:
        """The model's declaration as served now: its versions, the default pinned (so a reload
        keeps the default where registrations and set-default put it)."""
        entry = self.registry.entry(decl.name)
        whole = decl.model_copy(update={"default_version": entry.default or decl.versions[-1].version})
        self.registry.redeclare(whole)
        self.reloader.adopted(whole, root)

    async def remove(self, name: str, version: str) -> str:
        """Stop serving one version (drained, then unloaded); the model goes with its last one."""
        entry = self.registry.entry(name)
        rec = entry.records[version]
        last = len(entry.records) == 1
        if last:   # refused from now on, as a model a reload drops
            self.registry.remove(name)
        await self.rollout.retire(entry, [rec])
        left = [v for v in entry.decl.versions if v.version != version]
        if last:
            self.registry.forget(name)
            self.reloader.abandoned(name)
        elif left:
            self.declared(entry.decl.model_copy(update={"versions": left}))
        return f"{name}:{version} unloaded"

    def set_default(self, name: str, version: str) -> None:
        """`version` takes every request that names no version; the others stay routable by name."""
        self.registry.flip(name, {version: FULL_WEIGHT}, drain=[])
        self.declared(self.registry.entry(name).decl)
