"""The YAML configuration, validated completely at start-up (pydantic).

Every problem is reported at once, each line naming its key path (models.0.versions.1.path);
`tgw-broker check-config FILE` runs the same validation without starting anything.
"""
from __future__ import annotations

import hashlib
import os

import yaml
from pydantic import ValidationError

from . import arenas
from .schema import (BreakerDecl, Config, CrashLoopDecl, LeakDecl, ModelDecl, ServerDecl, SupervisorDecl,
                     TenantDecl, TensorDecl, VersionDecl, WorkersDecl)

# the rest of the broker imports the schema from here
__all__ = ["BreakerDecl", "Config", "ConfigError", "CrashLoopDecl", "LeakDecl", "ModelDecl", "ServerDecl",
           "SupervisorDecl", "TenantDecl", "TensorDecl", "VersionDecl", "WorkersDecl", "file_sha256", "load_config", "parse_config"]


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
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"].removeprefix("Value error, ")
        line = f"  {_loc(e['loc'])}: {msg}"
        if line not in lines:
            lines.append(line)
    return lines


def _resolve(path: str, base_dir: str) -> str:
    return path if os.path.isabs(path) else os.path.normpath(os.path.join(base_dir, path))


def _file_problems(data: object, base_dir: str) -> list[str]:
    """Model files must exist and match their sha256 (checked on the raw tree, best effort)."""
    problems = []
    for vpath, v in _items(data, ("models", "*", "versions", "*")):
        if not isinstance(v, dict) or not isinstance(v.get("path"), str):
            continue
        path = _resolve(v["path"], base_dir)
        if not os.path.isfile(path):
            problems.append(f"  {vpath}.path: model file not found: {path}")
        elif isinstance(v.get("sha256"), str) and file_sha256(path) != v["sha256"]:
            problems.append(f"  {vpath}.sha256: does not match {path} (sha256 {file_sha256(path)})")
    for key in ("auth_token_file", "curve_secret_key_file"):
        for kpath, v in _items(data, ("server", key)):
            path = _resolve(v, base_dir) if isinstance(v, str) else None
            if path is not None and not os.path.isfile(path):
                problems.append(f"  {kpath}: file not found: {path}")
            elif path is not None and os.stat(path).st_mode & 0o007:
                problems.append(f"  {kpath}: {path} is readable by every user; chmod o-rwx it (it is a secret)")
    return problems


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def parse_config(data: object, base_dir: str, source: str = "<dict>") -> Config:
    """Validate everything and report every problem at once; model paths come back absolute."""
    problems, cfg = [], None
    try:
        cfg = Config.model_validate(data)
    except ValidationError as err:
        problems += _pydantic_problems(err)
    problems += _duplicate_problems(data) + _file_problems(data, base_dir)
    if problems:
        raise ConfigError("\n".join([f"invalid config {source}: {len(problems)} problem(s)", *problems]))
    models = [m.model_copy(update={"versions": [v.model_copy(update={"path": _resolve(v.path, base_dir)})
                                                for v in m.versions]}) for m in cfg.models]
    sup, server = cfg.supervisor, cfg.server
    if sup.snapshot_dir is not None:
        sup = sup.model_copy(update={"snapshot_dir": _resolve(sup.snapshot_dir, base_dir)})
    server = server.model_copy(update={k: _resolve(getattr(server, k), base_dir) for k in
                                       ("auth_token_file", "curve_secret_key_file") if getattr(server, k)})
    # workers.*_arena_mb: auto becomes bytes here, once (arenas.py has the rule)
    return arenas.resolve(cfg.model_copy(update={"models": models, "supervisor": sup, "server": server}))


def load_config(path: str) -> Config:
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
    return parse_config(data, os.path.dirname(os.path.abspath(path)), path)
