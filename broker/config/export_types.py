"""The Python types a torch.export (.pt2) file needs registered before it loads, read without
torch: check-config's view of a load that would fail with "please check the warnings above".

A .pt2 archive keeps each program's input and output structure as pytree specs in its
models/*.json, each node naming its type ("builtins.tuple", "transformers.modeling_outputs.
SequenceClassifierOutput", ...). A type outside torch's own ones is registered by the module
that defines it (its name less the last part); unless the worker imports that module first
(`workers.preload`), torch.export.load fails. Best effort: an archive that cannot be read here
is the load's to judge.
"""
from __future__ import annotations

import importlib.util
import json
import zipfile

# modules whose types torch registers itself (at its import, always done in a worker)
DEFAULT_MODULES = ("builtins", "collections", "torch")
SPEC_KEYS = ("in_spec", "out_spec")


def needed_modules(path: str) -> list[str]:
    """The modules, in order, whose types the archive's pytree specs name, torch's own left out."""
    found: dict[str, None] = {}
    try:
        with zipfile.ZipFile(path) as archive:
            for name in archive.namelist():
                parts = name.split("/")
                if len(parts) == 3 and parts[1] == "models" and parts[2].endswith(".json"):
                    for type_name in _spec_types(json.loads(archive.read(name))):
                        module = type_name.rpartition(".")[0]
                        if module and not _default(module):
                            found[module] = None
    except (OSError, zipfile.BadZipFile, ValueError, RecursionError):
        return []
    return list(found)


def missing_preloads(path: str, preload: list[str]) -> list[str]:
    """One line per module the archive needs that `preload` does not name."""
    named = {entry for entry in preload if not entry.endswith((".py", ".so"))}
    named |= {entry.rsplit("/", 1)[-1][:-3] for entry in preload if entry.endswith(".py")}
    lines = []
    for module in needed_modules(path):
        if module in named:
            continue
        installed = importlib.util.find_spec(module.split(".")[0]) is not None   # finds, never imports
        lines.append(f"{path} needs the types of module {module} registered first: add it to workers.preload "
                     f"(workers.preload: [{module}]){'' if installed else f'; {module} is not installed here'}")
    return lines


def _default(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in DEFAULT_MODULES)


def _spec_types(node) -> list[str]:
    """Every type named by the pytree specs anywhere in a model's JSON."""
    types: list[str] = []
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, value in item.items():
                if key in SPEC_KEYS and isinstance(value, str):
                    types += _tree_types(json.loads(value))
                else:
                    stack.append(value)
        elif isinstance(item, list):
            stack.extend(item)
    return types


def _tree_types(spec) -> list[str]:
    """The types of a serialized treespec: [protocol, {"type", "context", "children_spec"}]."""
    types: list[str] = []
    stack = [spec[1]] if isinstance(spec, list) and len(spec) == 2 else []
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        if isinstance(node.get("type"), str):
            types.append(node["type"])
        stack.extend(node.get("children_spec") or [])
    return types
