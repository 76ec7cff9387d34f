"""Operator changes to the served versions while traffic flows: load (hot swap or canary),
unload, traffic weights, and the metadata that shows them.

A load adds the version as LOADING (no request may name it), lets placement load it beside
the others on every worker serving the model, and waits until all are warm. Then routing
flips in one synchronous step: the new version takes the traffic (swap) or its weight
(canary). The versions it replaces become DRAINING: what was admitted for them finishes, new
requests naming them are refused; once none is left they are dropped, placement unloads them
everywhere, and the answer waits until every worker has freed the memory. A failed load
removes the new version again and leaves routing as it was.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable, Optional

from pydantic import ValidationError

from tgw.shm.errors import Code, TgwError, fail
from tgw.shm.wire import PROTOCOL_VERSION, ControlReply, LoadVersion, Metadata, MetadataReply, ModelLoaded, \
    ModelMetadata, SetTraffic, UnloadVersion

from tgw.broker.config.roots import ModelFileError, PathRefused, check_file, check_handler_file, confine, \
    split_handler
from tgw.broker.config.schema import ModelDecl, VersionDecl
from tgw.broker.state.versions import VersionRecord, VersionState
from . import guarded
from .guarded import Decision, GuardHooks
from .placement import Placement
from .registry import FULL_WEIGHT, ModelEntry, Registry

FILE_REASONS = {"sha256": "checksum", "format": "format"}   # ModelFileError.field -> the error's reason
UNLOAD_WAIT_S = 60.0   # bound on waiting for workers to confirm an unload


def load_error(key: str, worker: str, msg: ModelLoaded) -> TgwError:
    """The answer to a load a worker could not do, by what went wrong."""
    text = f"{key} failed to load on {worker} ({msg.reason}): {msg.error}"
    if msg.reason == "out_of_memory":
        return fail(Code.OUT_OF_GPU_MEMORY, text, reason=msg.reason, worker=worker)
    if msg.reason in ("file", "checksum"):
        return fail(Code.INVALID_ARGUMENT, text, reason=msg.reason, worker=worker)
    return fail(Code.MODEL_EXECUTION_ERROR, text, reason=msg.reason or "load", worker=worker)


@dataclass(frozen=True)
class RolloutDeps:
    """What a rollout reads and calls (filled in by broker/core/assembly.py)."""
    registry: Registry      # writes versions: add, flip, retire, weigh, forget
    placement: Placement    # loads and unloads them on workers, and waits for that
    clock: Callable[[], float]
    declare_breakers: Callable[[ModelDecl, list[str], float], None]   # admission's, for a new version
    forget_breakers: Callable[[str, str], None]                       # (model, version) gone
    unserved: Callable[[list[VersionRecord], str], None]   # answers what a drain left queued for these
    # why unloading these versions (model, versions, the ready ones left) would break a pipeline ("": it would not)
    pipelines_blocking: Callable[[str, list[str], list[str]], str] = lambda model, versions, left: ""
    pipeline_metadata: Callable[[Optional[str]], list] = lambda name: []   # a pipeline's (None: every one)
    guards: Optional[GuardHooks] = None   # shadows and guarded rollouts (canary/); None: refused


class Rollout:
    def __init__(self, d: RolloutDeps, model_roots: list[str], load_timeout_s: float, drain_s: float):
        """`load_timeout_s`: how long every worker may take to load (workers.start_timeout_s);
        `drain_s`: how long past its model's timeout a retiring version's requests may take
        (supervisor.shutdown_grace_s) before what is still queued is answered MODEL_NOT_READY."""
        self.d, self.roots, self.load_timeout_s, self.drain_s = d, model_roots, load_timeout_s, drain_s
        self.registry, self.placement = d.registry, d.placement

    # ---- metadata ----------------------------------------------------------------------------

    def describe(self, entry: ModelEntry) -> ModelMetadata:
        return ModelMetadata(name=entry.name, inputs=entry.inputs, outputs=entry.outputs,
                             max_batch_size=entry.decl.max_batch_size, default_version=entry.default,
                             residency=entry.decl.residency,
                             versions=[r.info(self.placement.workers_of(r.key)) for r in entry.records.values()])

    def metadata(self, msg: Metadata) -> MetadataReply:
        pipelines = self.d.pipeline_metadata(msg.model)   # the one named, or with no name every one
        if msg.model is not None and pipelines:
            return MetadataReply(v=PROTOCOL_VERSION, id=msg.id, models=pipelines)
        entries = [self.registry.entry(msg.model)] if msg.model is not None else \
            [m for m in self.registry.models.values() if not m.removed]
        return MetadataReply(v=PROTOCOL_VERSION, id=msg.id, models=[self.describe(m) for m in entries] + pipelines)

    def check_pipelines(self, entry: ModelEntry, versions: list[str], coming: str | None = None) -> None:
        """Refuse to take these versions away from a pipeline that needs them (`coming`: the
        version a swap puts in their place)."""
        left = [v for v in entry.routable() if v not in versions] + ([coming] if coming else [])
        why = self.d.pipelines_blocking(entry.name, versions, left)
        if why:
            raise fail(Code.INVALID_ARGUMENT, f"refused: {why}; change the pipeline (a reload) first",
                       model=entry.name, versions=versions, reason="used_by_pipeline")

    def reply(self, msg, entry: ModelEntry, message: str, since: int) -> ControlReply:
        events = [e for e in self.placement.events if e["seq"] > since]
        return ControlReply(v=PROTOCOL_VERSION, id=msg.id, message=message, model=self.describe(entry),
                            details={"events": events})

    # ---- load --------------------------------------------------------------------------------

    async def load(self, msg: LoadVersion) -> ControlReply:
        entry = self.registry.entry(msg.model)
        since = self.placement.seq
        decl = await self.checked_decl(entry, msg.version, msg.path, msg.sha256, msg.format, msg.handler)
        if msg.weight is not None and not 0 <= msg.weight <= 1_000_000:
            raise fail(Code.INVALID_ARGUMENT, f"weight must be 0..1000000, got {msg.weight}", weight=msg.weight)
        if msg.weight is None:   # a swap drains what has weight: not a version a pipeline is pinned to
            self.check_pipelines(entry, [r.version for r in entry.records.values()
                                         if r.state is VersionState.READY and r.weight > 0], decl.version)
        if msg.shadow is not None or msg.policy is not None:
            if self.d.guards is None:
                raise fail(Code.INVALID_ARGUMENT, "this broker has no shadows or rollout policies", model=entry.name)
            guarded.check_load(self.d.guards, entry, msg)
        rec = await self.load_beside(entry, decl)
        if msg.shadow is not None:   # no traffic of its own, and no caller may name it: copies only
            self.registry.mark_shadow(entry.name, rec.version, True)
            self.registry.flip(entry.name, guarded.weights_with(entry, rec, 0))
            message = guarded.started(self.d.guards, entry, rec, msg)
        elif msg.weight is None:   # a swap: the versions that had weight drain
            replaced = self.registry.flip(entry.name, {rec.version: FULL_WEIGHT})
            await self.retire(entry, replaced)
            message = f"{rec.key} serves every request that names no version" + (
                f"; {', '.join(r.version for r in replaced)} drained and unloaded" if replaced else "")
        else:
            self.registry.flip(entry.name, {**{r.version: r.weight for r in entry.records.values()
                                               if r.state is VersionState.READY}, rec.version: msg.weight})
            share = entry.traffic.share(rec.version)
            message = f"{rec.key} loaded with weight {msg.weight} ({share:.1%} of unnamed requests)"
            if msg.policy is not None:
                message += guarded.started(self.d.guards, entry, rec, msg)
        return self.reply(msg, entry, message, since)

    async def decide(self, d: Decision) -> ControlReply:
        """A guard's verdict: promote (a swap to it) or roll back (drained and unloaded)."""
        return await guarded.carry_out(self, d)

    async def checked_decl(self, entry: ModelEntry, version: str, path: str | None, sha256: str | None,
                           fmt: str | None = None, handler: str | None = None) -> VersionDecl:
        """The version to load: a model's path confined to model_roots and its file checked, its
        format included (off the loop: hashing a large file takes a while); a stage's handler
        file confined and parsed for its class, as at config load."""
        if version in entry.records:
            raise fail(Code.INVALID_ARGUMENT, f"model {entry.name!r} already has version {version!r} "
                       f"({entry.records[version].state.value}); a version's name identifies its outputs, so load "
                       "new weights under a new version", model=entry.name, version=version, reason="exists")
        stage = entry.decl.is_stage
        source, wrong = (handler, path) if stage else (path, handler)
        if wrong is not None:
            raise fail(Code.INVALID_ARGUMENT, f"{entry.name!r} is a stage: its versions name a handler (FILE.py:Class "
                       "or module:Class), not a path" if stage else f"{entry.name!r} is a model: its versions name "
                       "a model file (path), not a handler", model=entry.name, version=version, reason="wrong_source")
        declared = next((v for v in entry.decl.versions if v.version == version), None)
        if source is None:
            if declared is None:
                raise fail(Code.INVALID_ARGUMENT, f"version {version!r} of {entry.name!r} is not in the config: give "
                           f"its {'handler' if stage else 'path'}", model=entry.name, version=version,
                           reason="no_path")
            source, sha256, fmt = declared.handler if stage else declared.path, sha256 or declared.sha256, \
                fmt or declared.format
        try:
            decl = VersionDecl(version=version, sha256=sha256, format=fmt,
                               **({"handler": source} if stage else {"path": source}))
        except ValidationError as exc:  # the schema's rules: version name, sha256 form, handler form
            error = exc.errors()[0]
            hint = " (FILE.py:Class or module:Class)" if "handler" in error["loc"] else ""
            raise fail(Code.INVALID_ARGUMENT, f"invalid version {version!r}: "
                       f"{error['msg'].removeprefix('Value error, ')}{hint}", version=version) from None
        if stage:
            return decl.model_copy(update={"handler": await self.checked_handler(decl.handler, decl.sha256),
                                           "format": "stage"})
        real, fmt = await self._in_roots(source, "model path", {"path": source}, check_file, sha256, fmt)
        return decl.model_copy(update={"path": real, "format": fmt})

    async def _in_roots(self, source: str, what: str, named: dict, check, *args):
        """(`source` confined to model_roots, what `check(real, *args)` returns, run off the loop:
        hashing a large file takes a while); a refusal is INVALID_ARGUMENT with `named` details."""
        try:
            real = confine(source, self.roots)
            return real, await asyncio.get_running_loop().run_in_executor(None, check, real, *args)
        except PathRefused as exc:
            raise fail(Code.INVALID_ARGUMENT, f"{what} refused: {exc}", reason="outside_model_roots",
                       model_roots=self.roots, **named) from None
        except ModelFileError as exc:
            raise fail(Code.INVALID_ARGUMENT, str(exc), reason=FILE_REASONS.get(exc.field, "file"), **named) from None

    async def checked_handler(self, handler: str, sha256: str | None) -> str:
        """A stage's handler as the worker is to import it: a file's confined real path
        ("/real/file.py:Class"), the file parsed for its class and its sha256 checked (never
        run: the broker runs no stage code); a module ("package.module:Class") as given, the
        worker's environment is its to import from (as at config load)."""
        where, cls = split_handler(handler)
        if not where.endswith(".py"):
            return handler
        real, _ = await self._in_roots(where, "handler file", {"handler": handler}, check_handler_file, sha256, cls)
        return f"{real}:{cls}"

    async def load_beside(self, entry: ModelEntry, decl: VersionDecl) -> VersionRecord:
        """Load the version on every worker serving the model (one, for an on-demand model) and
        wait until all have it warm; on any failure take it out again and raise why."""
        rec = self.registry.add_version(entry.name, decl)
        key = rec.key
        self.d.declare_breakers(entry.decl, [decl.version], self.d.clock())
        placement = self.placement
        placement.failures.pop(key, None)
        placement.watching.add(key)
        try:
            if entry.on_demand:
                placement.place(rec)
            placement.reconcile()

            def settled() -> bool:
                live = placement.live(entry.name)   # those whose role holds it (roles.py)
                held = [key in w.models for w in live]
                return bool(placement.failures.get(key)) or (
                    bool(live) and (any(held) if entry.on_demand else all(held)))

            warm = await placement.until(settled, self.load_timeout_s)
            failed = placement.failures.pop(key, None)
        finally:
            placement.watching.discard(key)
        if warm and not failed:
            return rec
        await self.drop(entry, [rec])
        if failed:
            w, why = failed[0]
            raise load_error(key, w.name, why)
        raise fail(Code.MODEL_NOT_READY, f"{key} was not loaded on every worker within {self.load_timeout_s:g} s "
                   "(workers.start_timeout_s); it was taken out again", model=entry.name, version=decl.version)

    # ---- retiring ----------------------------------------------------------------------------

    async def retire(self, entry: ModelEntry, records: list[VersionRecord]) -> None:
        """Let what was admitted for these versions finish, then unload them everywhere."""
        self.registry.retire(entry.name, records)
        drain_s = entry.decl.timeout_ms / 1000 + self.drain_s
        await self.placement.until(lambda: all(r.active <= 0 for r in records), drain_s)
        self.d.unserved(records, "its version was unloaded before it ran (it outlived the drain)")
        await self.drop(entry, records)

    async def drop(self, entry: ModelEntry, records: list[VersionRecord]) -> None:
        """Forget these versions and wait until no worker holds them."""
        keys = [r.key for r in records]
        if self.d.guards is not None:   # no more copies to them, no guard watching them
            self.d.guards.gone(entry.name, [r.version for r in records])
        self.registry.forget(entry.name, [r.version for r in records])
        for r in records:
            self.d.forget_breakers(entry.name, r.version)
        self.placement.unwant(keys)
        self.placement.reconcile()
        await self.placement.until(lambda: not any(map(self.placement.holds_anywhere, keys)), UNLOAD_WAIT_S)

    # ---- unload and traffic ------------------------------------------------------------------

    async def unload(self, msg: UnloadVersion) -> ControlReply:
        entry = self.registry.entry(msg.model)
        since = self.placement.seq
        if msg.version is not None and msg.version not in entry.records:
            raise fail(Code.VERSION_NOT_FOUND, f"model {entry.name!r} has no version {msg.version!r}",
                       model=entry.name, version=msg.version, available=list(entry.records))
        records = [entry.records[msg.version]] if msg.version is not None else list(entry.records.values())
        self.check_pipelines(entry, [r.version for r in records])
        await self.retire(entry, records)   # the newest version left takes unnamed requests if none has weight
        left = f"; {entry.default} takes unnamed requests" if entry.default else "; no version is loaded"
        return self.reply(msg, entry, f"{entry.name}: {', '.join(r.version for r in records)} drained and "
                          f"unloaded{left}", since)

    def traffic(self, msg: SetTraffic) -> ControlReply:
        entry = self.registry.entry(msg.model)
        since = self.placement.seq
        ready = entry.routable()
        unknown = [v for v in msg.weights if v not in ready or entry.records[v].shadow]   # a shadow answers nobody
        if unknown:
            raise fail(Code.VERSION_NOT_FOUND, f"model {entry.name!r} has no ready version {unknown}; ready: {ready}",
                       model=entry.name, version=unknown[0], available=ready)
        bad = {v: w for v, w in msg.weights.items() if not 0 <= w <= 1_000_000}
        if bad or sum(msg.weights.values()) <= 0:
            raise fail(Code.INVALID_ARGUMENT, f"weights must be 0..1000000 and sum to more than 0, got {msg.weights}",
                       weights=msg.weights)
        self.registry.weigh(entry.name, msg.weights)
        self.placement.note("traffic", f"{entry.name}:", message=str(msg.weights))
        split = ", ".join(f"{v} {entry.traffic.share(v):.1%}" for v in entry.traffic.versions)
        return self.reply(msg, entry, f"{entry.name}: unnamed requests now go {split}", since)
