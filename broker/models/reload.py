"""SIGHUP and `tgw-broker reload`: re-read the config file and apply the difference.

What may change while serving: models added or removed, versions added or removed, weights
and default_version, a model's timeout_ms, max_queue and cache, model_roots,
workers.max_model_memory, and the warmup section (for the loads after the reload's own).
Anything else that differs needs a restart, and the reload refuses as a whole, naming it. A
version's source is fixed: a model file's path or sha256, a stage's handler, its sha256 or its
handler file's content (hashed as each config is read), and a stage's options and
warmup_inputs for the versions it keeps serving: the change is refused, new code, options or
examples come as new versions (with none of the served ones kept, the new versions load with
the new ones). A stage's device picks
its workers: a restart. The reload is one transaction: every new version is loaded first
(beside what serves); if any load fails, what was loaded is taken out again and nothing has
changed. Then routing flips for every model in one step, and the versions and models left out
drain and unload. The outcome, good or bad, is logged and kept for `tgw-broker status`.

An override (a Reload with `models`: Triton's repository load with a config, protocol/uploads.py)
reads no file: each model entry given is validated as a config's, and served in place of the
model of its name (that one drained and unloaded first: its inputs, files and code may all
differ) or beside the others; later reloads of the file keep it.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable

from tgw.shm.errors import Code, fail
from tgw.shm.wire import PROTOCOL_VERSION, ControlReply, Reload, model_key

from tgw.broker.config.load import arenas
from tgw.broker.config.load import (Config, ConfigError, ModelDecl, WarmupDecl, file_sha256, load_config,
                                     parse_config, repository_config, with_grpc_port, with_http_port, with_models,
                                     without_model)
from tgw.broker.config.roots import split_handler
from tgw.broker.state.versions import VersionRecord
from .placement import Placement
from .registry import ModelEntry, Registry
from .rollout import Rollout

HOT_MODEL_KEYS = {"versions", "default_version", "timeout_ms", "max_queue", "cache"}   # cache: starts empty
STAGE_KEYS = {"options", "device", "warmup_inputs"}   # a stage's: stage_changes() says when they may change


def handler_digests(cfg: Config) -> dict[str, str | None]:
    """"model:version" -> the sha256 of each stage version's handler file as it is now (None: a
    module handler, or a file that cannot be read: the config check reported it)."""
    digests: dict[str, str | None] = {}
    for m in cfg.models:
        for v in m.versions:
            if v.handler is not None:
                where, _ = split_handler(v.handler)
                digests[model_key(m.name, v.version)] = _digest(where) if where.endswith(".py") else None
    return digests


def _digest(path: str) -> str | None:
    try:
        return file_sha256(path)
    except OSError:
        return None


def stage_changes(old: Config, new: Config, was: dict, now: dict, served: Callable[[str], set]) -> list[str]:
    """What a reload cannot apply to a stage: a kept version whose handler, sha256 or handler
    file (digests `was` of the old config, `now` of the new) changed, as a model file's path is
    fixed; options changed while versions it serves are kept (`served(name)`: the versions
    loaded); a device changed."""
    before, keys = {m.name: m for m in old.models}, []
    for m in new.models:
        o = before.get(m.name)
        if o is None or not (o.is_stage or m.is_stage):
            continue
        prior = {v.version: v for v in o.versions}

        def changed(v) -> bool:
            p, key = prior[v.version], model_key(m.name, v.version)
            return (v.handler, v.sha256) != (p.handler, p.sha256) or was.get(key) != now.get(key)
        keys += [f"models.{m.name}.versions.{v.version} (handler, sha256 or the handler file's content: a stage "
                 "version's code is fixed; serve new code as a new version)" for v in m.versions
                 if v.version in prior and changed(v)]
        kept = [v.version for v in m.versions if v.version in served(m.name)]
        if o.options != m.options and kept:
            keys.append(f"models.{m.name}.options (versions {kept} would keep the options they were loaded with: a "
                        "stage version's options are fixed; give the new options to new versions, leaving these out)")
        if o.warmup_inputs != m.warmup_inputs and kept:   # a restarted worker would try them on its examples
            keys.append(f"models.{m.name}.warmup_inputs (versions {kept} were proven on the examples they were "
                        "loaded with; give new examples with new versions, leaving these out)")
        if (o.device or "cpu") != (m.device or "cpu"):
            keys.append(f"models.{m.name}.device (a stage's device picks the workers that hold it)")
    return keys


def restart_only(old: Config, new: Config) -> list[str]:
    """The keys whose change a running broker cannot apply."""
    keys = [k for k in ("server", "supervisor", "tenants", "default_tenant", "require_tenant", "http", "grpc",
                        "observability", "model_store", "torchserve")
            if getattr(old, k) != getattr(new, k)]
    if old.workers.model_dump(exclude={"max_model_memory"}) != new.workers.model_dump(exclude={"max_model_memory"}):
        keys.append("workers")
    now = {m.name: m for m in new.models}
    for m in old.models:
        if m.name in now:
            hot = HOT_MODEL_KEYS | (STAGE_KEYS if m.is_stage or now[m.name].is_stage else set())
            keys += [f"models.{m.name}.{k}" for k in ModelDecl.model_fields if k not in hot
                     and getattr(m, k) != getattr(now[m.name], k)]
            was = {v.version: v for v in m.versions}
            keys += [f"models.{m.name}.versions.{v.version} (path or sha256: a version's file is fixed; load new "
                     "weights as a new version)" for v in now[m.name].versions
                     if v.version in was and v.handler is None and
                     (v.path, v.sha256) != (was[v.version].path, was[v.version].sha256)]
    return keys


@dataclass(frozen=True)
class ReloadDeps:
    """What a reload reads and calls besides the rollout (filled in by broker/core/assembly.py)."""
    registry: Registry
    placement: Placement             # reconciles, and holds the workers' model budget
    uptime: Callable[[], float]      # seconds since the broker started, as status counts uptime_s
    declare: Callable[[ModelDecl], None]         # a new model's queue, counters and limits
    set_max_queue: Callable[[str, int], None]    # a served model's queue bound (models[].max_queue)
    pipelines: Callable[[list], None] = lambda decls: None   # the new config's pipelines served (after the flip)
    warmup: Callable[[WarmupDecl, list[str]], None] = lambda decl, models: None   # the new warmup section, its models


class Reloader:
    def __init__(self, d: ReloadDeps, rollout: Rollout, cfg: Config, path: str | None, outcome: dict):
        """`outcome`: the last reload's, which this reloader alone writes (status reads it)."""
        self.d, self.rollout, self.cfg, self.path = d, rollout, cfg, path
        self.outcome = outcome
        if path:
            outcome["path"] = path
        # the handler files' content as the served config was read (small files: read at start)
        self.digests = handler_digests(cfg) if path else {}
        self.overrides: dict[str, ModelDecl] = {}   # models served as a load's config override said

    async def reload(self, msg: Reload) -> ControlReply:
        if msg.models is not None:
            return await self.override(msg)
        try:
            message, changes = await self._reload()
        except Exception as exc:
            why = exc.message if hasattr(exc, "message") else str(exc)
            self.outcome.update(at_s=self._uptime(), ok=False, message=why)
            raise
        self.outcome.update(at_s=self._uptime(), ok=True, message=message)
        return ControlReply(v=PROTOCOL_VERSION, id=msg.id, message=message, details=changes)

    def _uptime(self) -> float:
        return round(self.d.uptime(), 3)

    async def _reload(self) -> tuple[str, dict]:
        if self.path is None and self.cfg._repository_flag is None:
            raise fail(Code.INVALID_ARGUMENT, "this broker serves the embedded demo: there is no config file to reload")
        try:  # hashing model files takes a while: off the loop
            new, digests = await asyncio.get_running_loop().run_in_executor(None, self._read)
        except ConfigError as exc:
            raise fail(Code.INVALID_ARGUMENT, f"reload refused, nothing changed: {exc}",
                       reason="invalid_config") from None
        if self.cfg._http_port is not None:   # `start --http-port` still holds
            new = with_http_port(new, self.cfg._http_port)
        if self.cfg._grpc_port is not None:   # and `start --grpc-port`
            new = with_grpc_port(new, self.cfg._grpc_port)
        if self.overrides:   # what loads with a config override put in place stays
            new = new.model_copy(update={"models": [m for m in new.models if m.name not in self.overrides]
                                         + list(self.overrides.values())})
        if self.cfg._extra_models:   # TorchServe archives served beside the file's models stay
            try:
                new = with_models(new, self.cfg._extra_models, self.cfg._extra_roots)
            except ConfigError as exc:
                raise fail(Code.INVALID_ARGUMENT, f"reload refused, nothing changed: {exc}",
                           reason="invalid_config") from None
            digests = handler_digests(new)
        refused = restart_only(self.cfg, new) + self._arena_misfits(new) + \
            stage_changes(self.cfg, new, self.digests, digests, self._served)
        if refused:
            raise fail(Code.INVALID_ARGUMENT, "reload refused, nothing changed: these changes need a restart: "
                       + "; ".join(refused), reason="needs_restart", keys=refused)
        changes = await self._apply(new)
        self.cfg, self.digests = new, digests
        done = {k: v for k, v in changes.items() if v}
        source = self.path or " ".join(self.cfg._repository_flag)
        return (f"reloaded {source}: " + ("; ".join(f"{k} {v}" for k, v in done.items()) if done else "no changes"),
                changes)

    def adopted(self, decl: ModelDecl, root: str) -> None:
        """A model added while serving (a TorchServe archive registered), or its declaration with
        its versions now: kept by later reloads."""
        self.cfg = with_models(without_model(self.cfg, decl.name), [decl], [root] if root else [])
        # its entry file's content, as a reload compares it
        self.digests = {**self.digests, **handler_digests(self.cfg.model_copy(update={"models": [decl]}))}

    def abandoned(self, name: str) -> None:
        """An added model unregistered: later reloads leave it out."""
        self.cfg = without_model(self.cfg, name)

    def _read(self) -> tuple[Config, dict]:
        repo = self.cfg._repository_flag   # `start --model-repository`, read again as the file is
        cfg = load_config(self.path, repo) if self.path is not None else repository_config(repo)
        return cfg, handler_digests(cfg)

    def _served(self, name: str) -> set[str]:
        entry = self.d.registry.models.get(name)
        return set(entry.records) if entry is not None else set()

    def _arena_misfits(self, new: Config, old: set[str] | None = None) -> list[str]:
        """New models (those not in `old`, by default the served config's) must fit the arenas
        the workers were started with."""
        old = {m.name for m in self.cfg.models} if old is None else old
        k, limit = new.server.max_inflight_batches_per_worker, new.server.max_request_bytes
        w = self.cfg.workers
        return [f"models.{m.name} (needs {arenas.input_need(m, k, limit)} input / {arenas.output_need(m, k)} output "
                f"arena bytes; the workers have {w.input_bytes} / {w.output_bytes})"
                for m in new.models if m.name not in old and
                (arenas.input_need(m, k, limit) > w.input_bytes or arenas.output_need(m, k) > w.output_bytes)]

    # ---- a load's config override ------------------------------------------------------------

    async def override(self, msg: Reload) -> ControlReply:
        """Serve the models `msg` gives (each replacing the model of its name); answered once
        they are loaded. Nothing changes when one is refused before the old one is drained."""
        decls = [self._validated(d) for d in msg.models]
        done = []
        for decl in decls:
            done.append(await self._override_one(decl))
        return ControlReply(v=PROTOCOL_VERSION, id=msg.id, message="; ".join(done),
                            details={"models": [d.name for d in decls]})

    def _validated(self, entry: dict) -> ModelDecl:
        """A model entry checked as the config file's are (schema, files in model_roots, sha256)."""
        name = entry.get("name") if isinstance(entry, dict) else None
        try:
            cfg = parse_config({"model_roots": self.cfg.model_roots, "models": [entry]}, "/",
                               f"(the config override of model {name!r})")
        except ConfigError as exc:
            raise fail(Code.INVALID_ARGUMENT, f"failed to load '{name}', {exc}", model=name,
                       reason="invalid_config") from None
        return cfg.models[0]

    async def _override_one(self, decl: ModelDecl) -> str:
        name = decl.name
        served = {m.name for m in self.cfg.models}
        users = [p.name for p in self.cfg.pipelines if name in {s.model for s in p.steps}]
        if users:
            raise fail(Code.INVALID_ARGUMENT, f"failed to load '{name}', it is a step of pipelines {users}: its "
                       "config cannot be replaced while they serve", model=name, reason="pipeline_step")
        without = self.cfg.model_copy(update={"models": [m for m in self.cfg.models if m.name != name]})
        new = without.model_copy(update={"models": [*without.models, decl]})
        misfits = self._arena_misfits(new, served - {name})
        if misfits:
            raise fail(Code.INVALID_ARGUMENT, f"failed to load '{name}', it does not fit the workers' arenas: "
                       + "; ".join(misfits), model=name, reason="arena")
        if name in served:   # drained and unloaded first: its declaration may change in every key
            await self._apply(without)
            self.cfg = without
            self.overrides.pop(name, None)
        changes = await self._apply(new)
        self.cfg = new
        self.overrides[name] = decl
        self.digests.update(handler_digests(new))
        return f"{name}: loaded from its config override ({', '.join(changes['versions loaded']) or 'no version'})" \
            + (", in place of the model of that name" if name in served else "")

    async def _apply(self, new: Config) -> dict:
        registry, rollout = self.d.registry, self.rollout
        old_names = {m.name for m in self.cfg.models}
        added = [m for m in new.models if m.name not in old_names]
        for m in added:
            self._declare(m)
        loaded: list[tuple[ModelEntry, VersionRecord]] = []
        reoptioned: list[ModelDecl] = []   # stages whose new versions load with new options: as they were
        try:
            for m in new.models:
                entry = registry.models[m.name]
                if (m.options, m.warmup_inputs) != (entry.decl.options, entry.decl.warmup_inputs):
                    reoptioned.append(entry.decl)   # a stage none of whose served versions is kept
                    registry.redeclare(entry.decl.model_copy(update={"options": m.options,
                                                                     "warmup_inputs": m.warmup_inputs}))
                for v in m.versions:
                    if v.version not in entry.records:
                        decl = await rollout.checked_decl(entry, v.version, v.path, v.sha256, v.format, v.handler)
                        loaded.append((entry, await rollout.load_beside(entry, decl)))
        except BaseException:
            for entry, rec in loaded:
                await rollout.drop(entry, [rec])
            for decl in reoptioned:
                registry.redeclare(decl)
            for m in added:
                registry.forget(m.name)
            raise
        retiring = self._flip(new)
        await asyncio.gather(*(rollout.retire(entry, records) for entry, records in retiring))
        removed = [m.name for m in self.cfg.models if m.name not in {n.name for n in new.models}]
        for name in removed:
            registry.forget(name)
        return {"models added": [m.name for m in added], "models removed": removed,
                "versions loaded": [rec.key for _, rec in loaded],
                "versions unloaded": [r.key for _, records in retiring for r in records],
                "warmup changed": [k for k in type(new.warmup).model_fields
                                   if getattr(new.warmup, k) != getattr(self.cfg.warmup, k)]}

    def _declare(self, m: ModelDecl) -> None:
        """A new model: routable once its versions are loaded."""
        self.d.registry.declare(m)
        self.d.declare(m)

    def _flip(self, new: Config) -> list[tuple[ModelEntry, list[VersionRecord]]]:
        """One synchronous step: every model's declaration, weights and versions as the file says."""
        registry = self.d.registry
        keep = {m.name: m for m in new.models}
        retiring = []
        for name, entry in list(registry.models.items()):
            m = keep.get(name)
            if m is None:
                retiring.append((entry, registry.remove(name)))
                continue
            registry.redeclare(m)
            self.d.set_max_queue(name, m.max_queue)
            weights, wanted = m.weights(), {v.version for v in m.versions}
            # a version a worker's failed restart dropped meanwhile is no longer there to flip
            gone = registry.flip(name, {v: weights.get(v, 0) for v in entry.records if v in wanted},
                                 drain=[v for v in entry.records if v not in wanted])
            if gone:
                retiring.append((entry, gone))
        self.d.pipelines(new.pipelines)   # validated with the new models: they are declared as of now
        self.rollout.roots = new.model_roots
        self.d.placement.set_model_memory(new.workers.max_model_memory)
        self.d.warmup(new.warmup, [m.name for m in new.models])
        self.d.placement.reconcile()
        return retiring
