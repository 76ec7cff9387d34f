"""One loaded stage (docs/STAGES.md): its handler class imported and instantiated, set up once,
warmed up, and called on batches - the counterpart of runner.ModelRunner for format "stage".

A handler is "/abs/file.py:Class" (a file the broker confined to model_roots: the very bytes
hashed, when the config gives a sha256, are the ones executed; its folder joins sys.path so it
can import its siblings) or "package.module:Class" (imported like workers.preload's modules).
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from typing import Any

import torch

from tgw.shm.wire import ModelSpec, model_key

from .runner import ChecksumMismatch, ModelRunner
from .stage import StageBatch, StageContext
from .stage_outputs import host_outputs
from .stage_proof import prove


class StageLoadError(ImportError):
    """A handler that cannot be imported, lacks its class, or whose class cannot be made."""


def load_class(handler: str, sha256: str | None = None) -> type:
    """The class a handler names."""
    where, _, name = handler.rpartition(":")
    if not where or not name:
        raise StageLoadError(f"handler {handler!r} is not FILE.py:Class or module:Class")
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


class StageRunner:
    """Serves one stage version; its interface is the one the loader and serving loop use of a
    ModelRunner (key, outputs, nbytes, min_batch, warm_up, module), plus `call`."""

    def __init__(self, spec: ModelSpec, device: torch.device):
        self.spec, self.outputs = spec, spec.outputs
        # a cuda stage runs on this worker's GPU; a cpu stage on the CPU even on a GPU worker
        self.device = device if spec.device == "cuda" else torch.device("cpu")
        self.nbytes, self.min_batch = 0, 1
        self.footprint = None   # measured at load and warm-up (footprint.warm_measured)
        cls = load_class(spec.handler, spec.sha256)
        self.code_file = code_file(cls)   # where its frames are told from (failure_where.py)
        try:
            self.module = cls()
        except Exception as exc:
            raise StageLoadError(f"stage {self.key}: {cls.__name__}() failed: {type(exc).__name__}: {exc}") from exc
        if not callable(self.module):
            raise StageLoadError(f"stage {self.key}: {cls.__name__} has no __call__(batch)")
        setup = getattr(self.module, "setup", None)
        if setup is not None:
            setup(StageContext(name=spec.name, version=spec.version, dir=handler_dir(spec.handler),
                               device=self.device, threads=torch.get_num_threads(), options=dict(spec.options)))

    @property
    def key(self) -> str:
        return model_key(self.spec.name, self.spec.version)

    @property
    def label(self) -> str:
        return f"stage {self.spec.name} version {self.spec.version}"

    def warm_up(self) -> None:
        """Its own warmup(), then the proof: one call per warmup_inputs example (stage_proof.py)."""
        warmup = getattr(self.module, "warmup", None)
        if warmup is not None:
            warmup()
        prove(self.label, self.key, self.spec.inputs, self.spec.warmup_inputs, handler_dir(self.spec.handler),
              self.call, self.module, self.code_file, self.device)

    def call(self, inputs: dict[str, Any], rows: int) -> tuple[list, dict[int, str]]:
        """One batch through the stage: its outputs in declared order, checked and on the host
        (torch tensors, or stage_outputs.PackedBytes for bytes), and the rows it failed."""
        batch = StageBatch(rows, self.device, inputs)
        with torch.no_grad():   # not inference_mode: a stage may keep tensors it made across batches
            result = self.module(batch)
        return host_outputs(self.label, self.outputs, result, rows), batch.failed


def make_runner(spec: ModelSpec, device: torch.device) -> ModelRunner | StageRunner:
    """The runner a spec calls for: a stage's (format "stage") or a model file's."""
    return StageRunner(spec, device) if spec.format == "stage" else ModelRunner(spec, device)
