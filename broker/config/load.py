"""The YAML configuration, validated completely at start-up (pydantic).

Every problem is reported at once, each line naming its key path (models.0.versions.1.path);
`tgw-broker check-config FILE` runs the same validation without starting anything.
"""
from __future__ import annotations

import os
from typing import Optional

import yaml
from pydantic import ValidationError

from tgw.shm.model_format import MODEL_FORMATS

from . import arenas, repository
from .export_types import missing_preloads
from .labels import LabelFileError, read_labels
from .roots import ModelFileError, PathRefused, check_file, check_handler_file, confine, file_sha256, split_handler
from .pipelines import PipelineDecl, PipelineError, StepDecl
from .schema import BreakerDecl, Config, CrashLoopDecl, CudaFaultDecl, FragmentationDecl, GrpcDecl, HttpDecl, \
    LeakDecl, ModelDecl, ObservabilityDecl, ServerDecl, SupervisorDecl, TenantDecl, TensorDecl, TorchServeDecl, \
    VersionDecl, WarmupDecl, WorkersDecl

# the rest of the broker imports the schema from here
__all__ = ["BreakerDecl", "Config", "ConfigError", "CrashLoopDecl", "FragmentationDecl", "HttpDecl", "LeakDecl",
           "ModelDecl", "ObservabilityDecl", "PipelineDecl", "ServerDecl", "StepDecl",
           "SupervisorDecl", "TenantDecl", "TensorDecl", "TorchServeDecl", "VersionDecl", "WarmupDecl", "WorkersDecl",
           "file_sha256", "load_config", "parse_config", "repository_config"]


class ConfigError(ValueError):
    """One readable message listing every problem found, each with its key path."""


def _items(data: object, keys: tuple) -> list[tuple[str, object]]:
    """(key path, value) pairs at `keys` in a raw YAML tree; "*" walks a list, an int picks one
    element; whatever is malformed along the way is skipped (it has its own error)."""
    found = [("", data)]
    for key in keys:
        nxt = []
        for path, node in found:
            if isinstance(key, int):
                if isinstance(node, list) and key < len(node):
                    nxt.append((f"{path}.{key}".lstrip("."), node[key]))
            elif key == "*" and isinstance(node, list):
                nxt += [(f"{path}.{i}".lstrip("."), v) for i, v in enumerate(node)]
            elif key != "*" and isinstance(node, dict) and key in node:
                nxt.append((f"{path}.{key}".lstrip("."), node[key]))
        found = nxt
    return found


def _duplicate_problems(data: object) -> list[str]:
    """Checked on the raw tree so they are reported even when other keys fail validation."""
    groups = [(("models", "*", "name"), "model name")]
    for i, _ in enumerate(_items(data, ("models", "*"))):
        groups += [(("models", i, "versions", "*", "version"), "version"),
                   (("models", i, "inputs", "*", "name"), "input name"),
                   (("models", i, "outputs", "*", "name"), "output name")]
    problems = []
    for keys, what in groups:
        seen: dict = {}
        for path, name in _items(data, keys):
            if isinstance(name, str) and name in seen:
                problems.append(f"  {path}: duplicate {what} {name!r} (also at {seen[name]})")
            seen.setdefault(name, path)
    return problems


def _loc(parts: tuple) -> str:
    """Key path of a pydantic error, without the union-member tags pydantic inserts."""
    keep = [str(p) for p in parts if isinstance(p, int) or not any(c in str(p) for c in "[]'(")]
    return ".".join(keep) or "(top level)"


def _pydantic_problems(err: ValidationError) -> list[str]:
    lines = []
    for e in err.errors():
        raised = e.get("ctx", {}).get("error")
        if isinstance(raised, PipelineError):   # the pipelines' cross-checks: a key path each
            lines += [f"  {path}: {message}" for path, message in raised.problems]
            continue
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"].removeprefix("Value error, ")
        line = f"  {_loc(e['loc'])}: {msg}"
        if line not in lines:
            lines.append(line)
    return lines


GRPC_FILES = ("tls_cert_file", "tls_key_file", "tls_client_ca_file")   # relative: to the config file


def _resolve(path: str, base_dir: str) -> str:
    return path if os.path.isabs(path) else os.path.normpath(os.path.join(base_dir, path))


def _model_roots(data: object, base_dir: str) -> tuple[Optional[list[str]], list[str]]:
    """The real paths of model_roots (from the raw tree) and their problems; None when the key
    is malformed (its own error), so model paths are then not confined."""
    given = data.get("model_roots", []) if isinstance(data, dict) else []
    if not isinstance(given, list) or not all(isinstance(r, str) and r for r in given):
        return None, []
    named = [(f"model_roots.{i}", r) for i, r in enumerate(given)] or \
        [("model_roots (empty: the config file's folder)", base_dir)]
    roots = [os.path.realpath(os.path.join(base_dir, r)) for _, r in named]
    return roots, [f"  {key}: not a directory: {root}" for (key, _), root in zip(named, roots)
                   if not os.path.isdir(root)]


def _file_problems(data: object, base_dir: str, roots: Optional[list[str]]) -> tuple[list[str], dict[str, str]]:
    """Model files must lie in model_roots, exist, match their sha256 and hold their format
    (checked on the raw tree, best effort); also each version's format by key path."""
    problems, formats = [], {}
    for vpath, v in _items(data, ("models", "*", "versions", "*")):
        if isinstance(v, dict) and isinstance(v.get("handler"), str) and "path" not in v:
            formats[vpath] = "stage"
            problems += _handler_problems(vpath, v, base_dir, roots)
        if not isinstance(v, dict) or not isinstance(v.get("path"), str):
            continue
        sha256 = v.get("sha256") if isinstance(v.get("sha256"), str) else None
        fmt = v.get("format") if v.get("format") in MODEL_FORMATS else None
        path = os.path.join(base_dir, v["path"])   # not normalised: confine refuses a ".." as written
        try:
            formats[vpath] = check_file(confine(path, roots) if roots is not None else path, sha256, fmt)
            if formats[vpath] == "export":   # types torch.export.load needs registered first
                problems += [f"  {vpath}.path: {line}" for line in missing_preloads(path, _preload(data))]
        except PathRefused as err:
            problems.append(f"  {vpath}.path: {err}")
        except ModelFileError as err:
            problems.append(f"  {vpath}.{err.field}: {err}")
    for kpath, v in _items(data, ("models", "*", "outputs", "*", "labels")):
        if isinstance(v, str):
            try:   # its lines go back to clients: it lies in model_roots as model files do
                read_labels(confine(os.path.join(base_dir, v), roots) if roots is not None else v)
            except (PathRefused, LabelFileError) as err:
                problems.append(f"  {kpath}: {err}")
    for kpath, v in [kv for key in GRPC_FILES for kv in _items(data, ("grpc", key))]:
        path = _resolve(v, base_dir) if isinstance(v, str) else None
        if path is not None and not os.path.isfile(path):
            problems.append(f"  {kpath}: file not found: {path}")
    for key in ("auth_token_file", "curve_secret_key_file"):
        for kpath, v in _items(data, ("server", key)):
            path = _resolve(v, base_dir) if isinstance(v, str) else None
            if path is not None and not os.path.isfile(path):
                problems.append(f"  {kpath}: file not found: {path}")
            elif path is not None and os.stat(path).st_mode & 0o007:
                problems.append(f"  {kpath}: {path} is readable by every user; chmod o-rwx it (it is a secret)")
    return problems, formats


def _preload(data: object) -> list[str]:
    """workers.preload as written, its strings (the schema reports anything else)."""
    workers = data.get("workers") if isinstance(data, dict) else None
    preload = workers.get("preload") if isinstance(workers, dict) else None
    return [p for p in preload if isinstance(p, str)] if isinstance(preload, list) else []


def _handler_problems(vpath: str, v: dict, base_dir: str, roots: Optional[list[str]]) -> list[str]:
    """A stage's handler file lies in model_roots, exists, matches its sha256 and defines its
    class (parsed, never run); a module handler is the worker's to import."""
    where, cls = split_handler(v["handler"])
    if not where.endswith(".py") or not cls:
        return []   # a module (or malformed: the schema's pattern reports it)
    path = os.path.join(base_dir, where)   # not normalised: confine refuses a ".." as written
    sha256 = v.get("sha256") if isinstance(v.get("sha256"), str) else None
    try:
        check_handler_file(confine(path, roots) if roots is not None else path, sha256, cls)
    except PathRefused as err:
        return [f"  {vpath}.handler: {err}"]
    except ModelFileError as err:
        return [f"  {vpath}.{err.field}: {err}"]
    return []


def _source(v: VersionDecl, base_dir: str, roots: list[str], fmt: str) -> VersionDecl:
    """A version with its file's real path, or its handler file's ("/real/file.py:Class"), and
    its format."""
    if v.handler is None:
        return v.model_copy(update={"path": confine(os.path.join(base_dir, v.path), roots), "format": fmt})
    where, cls = split_handler(v.handler)
    if where.endswith(".py"):
        where = confine(os.path.join(base_dir, where), roots)
    return v.model_copy(update={"handler": f"{where}:{cls}", "format": "stage"})


def parse_config(data: object, base_dir: str, source: str = "<dict>") -> Config:
    """Validate everything and report every problem at once. model_roots and model paths come
    back as real paths (a model path is the confined file itself, symlinks resolved)."""
    base_dir = os.path.abspath(base_dir)
    problems, warnings, cfg = [], [], None
    if isinstance(data, dict):   # a Triton repository's models and pipelines join the config's own
        data, problems, warnings = repository.merged(data, base_dir)
    try:
        cfg = Config.model_validate(data)
    except ValidationError as err:
        problems += _pydantic_problems(err)
    roots, root_problems = _model_roots(data, base_dir)
    file_problems, formats = _file_problems(data, base_dir, roots)
    problems += root_problems + _duplicate_problems(data) + file_problems
    if problems:
        raise ConfigError("\n".join([f"invalid config {source}: {len(problems)} problem(s)", *problems]))
    models = [m.model_copy(update={"versions": [
        _source(v, base_dir, roots, formats[f"models.{i}.versions.{j}"]) for j, v in enumerate(m.versions)],
        "outputs": [t.model_copy(update={"labels": confine(os.path.join(base_dir, t.labels), roots)}) if t.labels else t
                    for t in m.outputs]})
        for i, m in enumerate(cfg.models)]
    sup, server = cfg.supervisor, cfg.server
    if sup.snapshot_dir is not None:
        sup = sup.model_copy(update={"snapshot_dir": _resolve(sup.snapshot_dir, base_dir)})
    server = server.model_copy(update={k: _resolve(getattr(server, k), base_dir) for k in
                                       ("auth_token_file", "curve_secret_key_file") if getattr(server, k)})
    grpc = cfg.grpc and cfg.grpc.model_copy(update={k: _resolve(getattr(cfg.grpc, k), base_dir) for k in GRPC_FILES
                                                    if getattr(cfg.grpc, k)})
    store = _resolve(cfg.model_store, base_dir) if cfg.model_store else None
    ts = cfg.torchserve and (cfg.torchserve.model_copy(update={"unpack_dir": _resolve(cfg.torchserve.unpack_dir, base_dir)})
                             if cfg.torchserve.unpack_dir else cfg.torchserve)
    # workers.*_arena_mb: auto becomes bytes here, once (arenas.py has the rule)
    out = arenas.resolve(cfg.model_copy(update={"model_roots": roots, "models": models, "supervisor": sup,
                                                "server": server, "grpc": grpc, "model_store": store,
                                                "torchserve": ts}))
    out._repository_warnings = warnings
    return out


def repository_config(directories: list[str]) -> Config:
    """`tgw-broker start --model-repository DIR ...` without --config: the repositories' models
    alone, every other key at its default (the repository folders are the model roots)."""
    directories = [os.path.abspath(d) for d in directories]
    out = parse_config({repository.KEY: directories}, directories[0],
                       f"--model-repository {' '.join(directories)}")
    out._repository_flag = directories
    return out


def load_config(path: str, model_repository: Optional[list[str]] = None) -> Config:
    """Read and validate a config file; no side effects, so it may run again (SIGHUP).
    `model_repository` (`start --model-repository`, each relative to the current folder) replaces
    the file's own key."""
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config {path} is not UTF-8 text: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {path}: top level must be a mapping with a 'models' key")
    if model_repository:
        model_repository = [os.path.abspath(d) for d in model_repository]
        data[repository.KEY] = model_repository
    out = parse_config(data, os.path.dirname(os.path.abspath(path)), path)
    out._repository_flag = model_repository or None
    return out


def with_face_port(cfg: Config, face: str, port: int) -> Config:
    """The config with its `face` ("http" or "grpc") on `port` (`tgw-broker start --http-port` /
    `--grpc-port`; turned on if the config has no such section); remembered, so a reload of the
    file applies it again."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"--{face}-port must be 0..65535, got {port}")
    decl = getattr(cfg, face)
    decl = decl.model_copy(update={"port": port}) if decl else {"http": HttpDecl, "grpc": GrpcDecl}[face](port=port)
    out = cfg.model_copy(update={face: decl})
    setattr(out, f"_{face}_port", port)
    return out


def with_http_port(cfg: Config, port: int) -> Config:
    return with_face_port(cfg, "http", port)


def with_grpc_port(cfg: Config, port: int) -> Config:
    return with_face_port(cfg, "grpc", port)


def with_models(cfg: Config, models: list[ModelDecl], roots: list[str]) -> Config:
    """The config with `models` served beside its own (TorchServe archives, broker/torchserve/),
    their folders `roots` added to model_roots; remembered, so a reload of the file keeps them."""
    names = {m.name for m in cfg.models}
    clash = sorted(m.name for m in models if m.name in names)
    if clash:
        raise ConfigError(f"model name(s) {', '.join(clash)} already served: an archive's model needs a name of its own")
    out = arenas.resolve(cfg.model_copy(update={
        "models": [*cfg.models, *models], "model_roots": [*cfg.model_roots, *(r for r in roots if r not in cfg.model_roots)]}))
    out._extra_models = [*cfg._extra_models, *models]
    out._extra_roots = [*cfg._extra_roots, *(r for r in roots if r not in cfg._extra_roots)]
    return out


def without_model(cfg: Config, name: str) -> Config:
    """The config without the added model `name` (an archive unregistered)."""
    out = cfg.model_copy(update={"models": [m for m in cfg.models if m.name != name]})
    out._extra_models = [m for m in cfg._extra_models if m.name != name]
    return out
