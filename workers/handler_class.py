"""Importing a handler's class (a stage's or a generator's): "/abs/file.py:Class" (a file the
broker confined to model_roots: the very bytes hashed, when the config gives a sha256, are the ones
executed; its folder joins sys.path so it can import its siblings) or "package.module:Class"
(imported like workers.preload's modules); the folder its setup finds its files in, and the file
its frames are told from; the instance made and set up, as both runners make theirs.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys

import torch

from . import triton_python
from .runner import ChecksumMismatch
from .stage import StageContext


class StageLoadError(ImportError):
    """A handler that cannot be imported, lacks its class, or whose class cannot be made."""


def load_class(handler: str, sha256: str | None = None) -> type:
    """The class a handler names."""
    where, _, name = handler.rpartition(":")
    if not where or not name:
        raise StageLoadError(f"handler {handler!r} is not FILE.py:Class or module:Class")
    triton_python.install()   # a Triton Python model's `import triton_python_backend_utils`
    module = _file_module(where, sha256) if where.endswith(".py") else _import(where)
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        found = "not a class" if cls is not None else "not defined there"
        raise StageLoadError(f"handler {handler!r}: {name!r} is {found} (in {where})")
    return cls


def _import(module: str):
    try:
        return importlib.import_module(module)
    except Exception as exc:
        raise StageLoadError(f"handler module {module!r} cannot be imported: {type(exc).__name__}: {exc}") from exc


def _file_module(path: str, sha256: str | None):
    """The module of a handler file, executed from the bytes read here (and hashed); one module
    per distinct content, so two stages of one file share it and an edited file is new code."""
    with open(path, "rb") as f:
        source = f.read()
    digest = hashlib.sha256(source).hexdigest()
    if sha256 is not None and digest != sha256.lower():
        raise ChecksumMismatch(f"{path}: sha256 is {digest}, expected {sha256}")
    name = f"tgw_stage_{os.path.basename(path)[:-3]}_{digest[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    parent = os.path.dirname(folder)
    if os.path.basename(folder).isdigit() and parent not in sys.path:
        sys.path.append(parent)   # a Triton version folder (REPO/M/1/model.py): M's files import as in Triton
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        exec(compile(source, path, "exec"), module.__dict__)   # noqa: S102 - the operator's own stage code
    except BaseException as exc:
        del sys.modules[name]
        raise StageLoadError(f"handler file {path} failed to import: {type(exc).__name__}: {exc}") from exc
    return module


def handler_dir(handler: str) -> str:
    """The folder a stage's setup finds its files in: a handler file's, or its module's."""
    where = handler.rpartition(":")[0]
    if where.endswith(".py"):
        return os.path.dirname(where)
    module = sys.modules.get(where)
    return os.path.dirname(os.path.abspath(module.__file__)) if getattr(module, "__file__", None) else ""


def code_file(cls: type) -> str:
    """The file the handler's class runs from, as its frames name it (a handler file's module
    is shared by every path of the same content: the first path loaded names it)."""
    module = sys.modules.get(cls.__module__)
    return os.path.abspath(module.__file__) if getattr(module, "__file__", None) else ""


def made(spec, who: str) -> tuple[object, str]:
    """The instance of the class `spec.handler` names and the file its frames are told from;
    StageLoadError (prefixed `who`) when the class cannot be made. A Triton Python model (a class
    with `execute` and no `__call__`) is made inside the stage that serves it (triton_python)."""
    cls = load_class(spec.handler, spec.sha256)
    triton = triton_python.is_triton_model(cls)
    if triton and spec.sequence is not None:
        raise StageLoadError(f"{who}: {cls.__name__} is a Triton Python model (it has execute()): tgw serves "
                             "those as stages, not as sequence handlers; drop the entry's sequence: section")
    try:
        if triton:
            from .triton_python.adapter import TritonStage   # imports torch-side code only when used
            return TritonStage(cls, spec), code_file(cls)
        return cls(), code_file(cls)
    except Exception as exc:
        raise StageLoadError(f"{who}: {cls.__name__}() failed: {type(exc).__name__}: {exc}") from exc


def set_up(module, spec, device: torch.device) -> None:
    """The instance's own setup(context), when it has one: once per worker process."""
    setup = getattr(module, "setup", None)
    if setup is not None:
        setup(StageContext(name=spec.name, version=spec.version, dir=handler_dir(spec.handler), device=device,
                           threads=torch.get_num_threads(), options=dict(spec.options),
                           batched=spec.batched))
