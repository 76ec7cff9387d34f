"""The faces' model answers: KServe v2 metadata and readiness, Triton's config and statistics of
a model or pipeline, and the repository extension (index, load, unload) wired to the operator's
lifecycle controls. Each face parses its request and calls these with plain values
(faces/http/repository_routes.py, faces/grpc/services.py).

Load and unload go through the operator exactly as `tgw-broker models load|unload` do: one at a
time, answered once done. Like the native control ops they are refused where anyone on the
network could send them: an HTTP face listening beyond loopback without server.auth_token_file.
A load with Triton's `config` and `file:` parameters (protocol/uploads.py) is off unless
server.allow_model_uploads.
"""
from __future__ import annotations

import asyncio
import ipaddress
from typing import Awaitable, Callable

import msgspec

from tgw.shm.errors import Code, TgwError, fail
from tgw.shm.wire import PROTOCOL_VERSION, LoadVersion, Reload, RolloutPolicy, UnloadVersion, model_key

from tgw.broker.models.registry import ModelEntry
from tgw.broker.observe.status import BrokerView, listed, pipeline_ready, serving
from tgw.broker.state.pool import WorkerState
from tgw.broker.state.versions import VersionState

from . import triton_docs, uploads
from .kserve import DATATYPE_OF

# Triton extensions both faces offer (the shared-memory ones only where the face allows regions;
# HTTP adds "generate", its own routes)
EXTENSIONS = ["classification", "binary_tensor_data", "model_repository", "metrics", "statistics", "sequence"]
STATES = {VersionState.LOADING: "LOADING", VersionState.READY: "READY", VersionState.DRAINING: "UNLOADING"}
LOAD_PARAMS = {"version": str, "path": str, "handler": str, "sha256": str, "weight": int, "format": str,
               "shadow": float, "policy": str,   # a shadow's fraction; a rollout policy as a JSON object's text
               "unload_dependents": bool}   # tritonclient sends it; tgw models have no dependents


def rollout_policy(text: str | None) -> RolloutPolicy | None:
    """parameters.policy: a JSON object of RolloutPolicy's fields (docs/ROLLOUT.md)."""
    if text is None:
        return None
    try:
        return msgspec.json.decode(text, type=RolloutPolicy)
    except msgspec.DecodeError as exc:   # ValidationError included: names the field
        raise fail(Code.INVALID_ARGUMENT, f"parameter policy: {exc}", parameter="policy") from None


def loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def io(specs, batched: bool = True) -> list[dict]:
    """Triton's metadata tensors: the batch dim shown as -1, none for a model without one."""
    return [{"name": t.name, "datatype": DATATYPE_OF[t.dtype], "shape": [-1, *t.shape] if batched else list(t.shape)}
            for t in specs]


class Repository:
    def __init__(self, view: BrokerView, entry: Callable[[str], ModelEntry], ask: Callable[..., Awaitable],
                 host: str = "127.0.0.1", token: str | None = None, face: str = "an HTTP face",
                 uploads: "uploads.Uploads | None" = None):
        """`entry`: the registry's model by name (raises MODEL_NOT_FOUND); `ask`: a message through
        the front door, answered (door.ask); `host`, `token`: where the face listens and the
        broker's token, which decide whether load and unload are open; `face`: named in refusals;
        `uploads`: where a load's files go (None: server.allow_model_uploads is off)."""
        self.view, self.entry, self.ask, self.face = view, entry, ask, face
        self.open_to_network = not loopback(host) and not token
        self.uploads, self.token = uploads, token

    # ---- metadata and readiness --------------------------------------------------------------

    def version_of(self, model: str, version: str | None) -> tuple[ModelEntry, str | None]:
        entry = self.entry(model)   # MODEL_NOT_FOUND
        if version is not None and version not in entry.records:
            raise fail(Code.VERSION_NOT_FOUND, f"model {model!r} has no version {version!r}",
                       model=model, version=version, available=list(entry.records))
        return entry, version

    def pipeline(self, model: str, version: str | None):
        """The pipeline of that name (None: not one), its version checked."""
        plan = self.view.pipelines.table.get(model)
        if plan is not None and version is not None and version != plan.version:
            raise fail(Code.VERSION_NOT_FOUND, f"pipeline {model!r} has no version {version!r}", model=model,
                       version=version, available=[plan.version])
        return plan

    def named(self, model: str, version: str | None) -> tuple[str, str | None]:
        """A path's model and version, a numeric alias (triton_docs.py) turned into its name."""
        if version is None:
            return model, None
        plan = self.view.pipelines.table.get(model)
        if plan is not None:
            return model, triton_docs.version_named([plan.version], version)
        entry = self.view.models.get(model)
        return model, triton_docs.version_named(entry.records, version) if entry is not None else version

    def triton_config(self, model: str, version: str | None) -> dict:
        plan = self.pipeline(model, version)
        if plan is not None:
            return triton_docs.pipeline_config(plan, {m: list(self.view.models[m].records)
                                                      for m in plan.models if m in self.view.models})
        entry, version = self.version_of(model, version)
        held = [version] if version else list(entry.records)
        return triton_docs.model_config(entry, version, triton_docs.holders(self.view.roster, entry.name, held))

    def triton_stats(self, model: str, version: str | None) -> list[dict]:
        plan = self.pipeline(model, version)
        if plan is not None:
            return [triton_docs.pipeline_stats(plan, self.view.pipelines.counters.get(plan.name))]
        entry, version = self.version_of(model, version)
        return triton_docs.model_stats(entry, self.view.stats.models.get(entry.name), version, self.view.roster)

    def all_stats(self) -> list[dict]:
        """Every model's versions, then every pipeline."""
        rows = [row for entry in listed(self.view) for row in
                triton_docs.model_stats(entry, self.view.stats.models.get(entry.name), roster=self.view.roster)]
        return rows + [triton_docs.pipeline_stats(plan, self.view.pipelines.counters.get(plan.name))
                       for plan in self.view.pipelines.table.values()]

    def kserve_metadata(self, model: str, version: str | None) -> dict:
        plan = self.pipeline(model, version)
        if plan is not None:
            return {"name": plan.name, "versions": [plan.version], "platform": "tgw_pipeline",
                    "inputs": io(plan.inputs, plan.max_batch_size > 0),
                    "outputs": io(plan.outputs, plan.max_batch_size > 0),
                    "parameters": {"max_batch_size": plan.max_batch_size, "default_version": plan.version,
                                   "steps": [{"name": s.name, "model": s.model, "version": s.version}
                                             for s in plan.steps]}}
        entry, version = self.version_of(model, version)
        shown = entry.records.get(version or entry.default or "")   # the version asked for, else the default
        return {"name": entry.name, "versions": [version] if version else entry.routable(),
                "platform": triton_docs.platform("stage" if entry.decl.is_stage else
                                                 shown.format if shown else "torchscript"),
                "inputs": io(entry.inputs, entry.decl.batched), "outputs": io(entry.outputs, entry.decl.batched),
                "parameters": {"max_batch_size": entry.decl.max_batch_size, "default_version": entry.default,
                               "residency": entry.decl.residency}}

    def ready(self, model: str, version: str | None) -> bool:
        """The model (its default version) or that version can be served now."""
        plan = self.pipeline(model, version)
        if plan is not None:
            return self.view.is_serving() and pipeline_ready(self.view, plan)
        entry, version = self.version_of(model, version)
        if not self.view.is_serving():
            return False
        if version is None:
            return serving(self.view, entry)
        if entry.records[version].state is not VersionState.READY:
            return False
        live = [w for w in self.view.roster if w.state is WorkerState.READY]
        return bool(live) if entry.on_demand else any(model_key(model, version) in w.models for w in live)

    # ---- the repository extension ------------------------------------------------------------

    def index_rows(self, only_ready: bool) -> list[dict]:
        """Every model version and pipeline: name, version, state, reason."""
        rows = []
        for entry in listed(self.view):
            for v, rec in entry.records.items():
                state = STATES[rec.state] if self.ready(entry.name, v) or rec.state is not VersionState.READY \
                    else "UNAVAILABLE"
                if not only_ready or state == "READY":
                    rows.append({"name": entry.name, "version": v, "state": state, "reason": rec.error})
        for plan in self.view.pipelines.table.values():
            state = "READY" if self.ready(plan.name, None) else "UNAVAILABLE"
            if not only_ready or state == "READY":
                rows.append({"name": plan.name, "version": plan.version, "state": state, "reason": ""})
        return rows

    async def load_model(self, model: str, parameters: dict) -> str:
        """parameters: version (default: the config's default version), path (a model's; default:
        the config's), handler (a stage's; default: the config's), sha256, weight (a canary beside
        what serves; none: a hot swap), format, shadow (a fraction: a shadow), policy (a rollout
        policy, docs/ROLLOUT.md, as JSON text). The operator's message."""
        self.control_allowed()
        upload, parameters = uploads.split(model, parameters)
        if upload is not None:
            return await self.load_upload(model, upload, parameters)
        try:
            entry = self.entry(model)
        except TgwError as err:   # Triton's words for a load of a model its repository lacks
            raise uploads.failed(model, "failed to poll from model repository: no model of that name in the broker's "
                                 "config", err.code, available=err.details.get("available")) from None
        params = self.params(parameters)
        version = params.get("version") or entry.decl.default_version or entry.decl.versions[-1].version
        if "version" not in params and version in entry.records:
            return f"{model_key(entry.name, version)} is already loaded"
        msg = LoadVersion(v=PROTOCOL_VERSION, model=entry.name, version=version, path=params.get("path"),
                          sha256=params.get("sha256"), weight=params.get("weight"), format=params.get("format"),
                          handler=params.get("handler"), shadow=params.get("shadow"),
                          policy=rollout_policy(params.get("policy")))
        reply, _ = await self.ask(msg)
        return reply.message

    async def load_upload(self, model: str, upload: "uploads.Upload", rest: dict) -> str:
        """Triton's load with a config override and files: the files (if any) form a new model
        folder, the config maps onto a tgw model over it, and the operator serves that in place of
        the model of this name."""
        if self.uploads is None or not self.token:
            raise uploads.failed(model, "a load with a config override or files is off on this broker: set "
                                 "server.allow_model_uploads: true (with server.auth_token_file; docs/SECURITY.md)",
                                 reason="model_uploads_disabled")
        extra = sorted(set(rest) - {"unload_dependents"})
        if extra:
            raise uploads.failed(model, f"parameters {extra} go with a load of the model's declared files, not with "
                                 "a config override")
        if upload.config is None:   # Triton's words: the files would form a folder with no config
            raise uploads.failed(model, "failed to poll from model repository: files sent without a config "
                                 "override (parameter config), which the files' model folder needs")
        loop = asyncio.get_running_loop()
        entry = self.view.models.get(model)
        files = uploads.version_files(entry.decl.versions) if entry is not None else []
        replaced = self.uploads.folder_of(files)
        if upload.files:
            folder = await loop.run_in_executor(None, self.uploads.write, model, upload.files)
        else:
            if entry is None or entry.removed:
                raise uploads.failed(model, "failed to poll from model repository: no model of that name is served; "
                                     "send its files with the config (file:1/model.pt ...)")
            folder = uploads.model_folder(model, files)
        try:
            decl, warnings = await loop.run_in_executor(None, uploads.translate, model, upload.config, folder)
            reply, _ = await self.ask(Reload(v=PROTOCOL_VERSION, models=[decl]))
        except BaseException:
            if upload.files:
                self.uploads.discard(folder)
            raise
        if replaced is not None and replaced != folder:   # drained and unloaded: its files go too
            self.uploads.discard(replaced)
        return reply.message + ("; warnings: " + "; ".join(warnings) if warnings else "")

    async def unload_model(self, model: str, parameters: dict) -> str:
        """parameters: version (default: every version of the model)."""
        self.control_allowed()
        params = self.params(parameters, ("version", "unload_dependents"))
        reply, _ = await self.ask(UnloadVersion(v=PROTOCOL_VERSION, model=model, version=params.get("version")))
        return reply.message

    def control_allowed(self) -> None:
        if self.open_to_network:
            raise fail(Code.UNAUTHENTICATED, f"repository load and unload are refused on {self.face} listening "
                       "beyond loopback unless server.auth_token_file is configured")

    @staticmethod
    def params(params: dict, allowed=("version", "path", "handler", "sha256", "weight", "format", "shadow",
                                       "policy")) -> dict:
        for key, value in params.items():
            want = LOAD_PARAMS.get(key) if key in allowed else None
            if want is None:
                raise fail(Code.INVALID_ARGUMENT, f"unknown parameter {key!r}: tgw takes {', '.join(allowed)}",
                           parameter=key)
            if want is float and type(value) in (int, str):   # JSON's 1 for 1.0; gRPC's repository
                try:                                             # parameters have no double: "0.1"
                    params[key] = value = float(value)
                except ValueError:
                    pass   # refused below, as given
            if type(value) is not want:
                raise fail(Code.INVALID_ARGUMENT, f"parameter {key} must be a {want.__name__}, got {value!r}",
                           parameter=key)
        return params
