"""A TorchServe model archive read and unpacked, and the tgw stage entry that serves it.

`torch-model-archiver` writes a .mar (a zip; `--archive-format tgz` a .tar.gz, `no-archive` a
folder) holding MAR-INF/MANIFEST.json and the model's files: `model.serializedFile` (weights or a
TorchScript file), `model.modelFile` (an eager model's class), `model.handler` (a built-in name
or a file in the archive, `file.py[:function]`), the extra files beside them,
`model.requirementsFile` and `model.configFile` (model-config.yaml). The broker reads only
the manifest and the config file (it runs no archive code, and never imports torch); it unpacks
the archive into a folder of its own, named by the archive's sha256, and writes there the entry
file whose class the worker serves as a stage (workers/torchserve_handler.py). The folder is a
model root, so the entry is confined like any handler file.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass, field

import yaml

MANIFEST = "MAR-INF/MANIFEST.json"
ENTRY_FILE = "tgw_torchserve_entry.py"
ENTRY_CLASS = "TorchServeEntry"
ENTRY_TEXT = f'''"""tgw's entry for this unpacked TorchServe archive (written by tgw-broker: this folder is the model_dir)."""
from tgw.workers.torchserve_handler import TorchServeStage


class {ENTRY_CLASS}(TorchServeStage):
    pass
'''
RUNTIMES = ("python", "python3")
DEFAULT_MAX_BATCH_DELAY_MS = 100   # TorchServe's default
DEFAULT_RESPONSE_TIMEOUT_S = 120   # TorchServe's default_response_timeout


class ArchiveError(ValueError):
    """An archive tgw cannot serve; the message names the file and why."""


@dataclass(frozen=True)
class Archive:
    """One unpacked archive: what its manifest says and where its files lie."""
    source: str                 # the .mar (or folder) it came from
    dir: str                    # the unpacked folder: TorchServe's model_dir
    name: str                   # model.modelName
    version: str                # model.modelVersion
    handler: str
    manifest: dict
    config: dict = field(default_factory=dict)   # model-config.yaml, {} when none
    warnings: tuple[str, ...] = ()

    @property
    def entry(self) -> str:
        return f"{os.path.join(self.dir, ENTRY_FILE)}:{ENTRY_CLASS}"


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    if os.path.isdir(path):   # a no-archive folder: its manifest names it
        with open(os.path.join(path, MANIFEST), "rb") as f:
            digest.update(f.read())
        digest.update(os.path.realpath(path).encode())
        return digest.hexdigest()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def unpack(path: str, into: str) -> Archive:
    """The archive at `path` unpacked under `into` (once: a folder named by its sha256 is reused)
    and read; ArchiveError when it is not one tgw can serve."""
    if not os.path.exists(path):
        raise ArchiveError(f"{path}: no such file")
    try:
        digest = sha256_of(path)
    except OSError as exc:
        raise ArchiveError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    base = os.path.basename(path.rstrip("/"))
    stem = base.removesuffix(".mar").removesuffix(".tar.gz").removesuffix(".tgz").removesuffix(".zip")
    dest = os.path.join(into, f"{stem}-{digest[:16]}")
    if not os.path.exists(os.path.join(dest, ENTRY_FILE)):   # the entry is written last: a whole unpack
        try:
            os.makedirs(into, mode=0o700, exist_ok=True)
            work = tempfile.mkdtemp(prefix=f".{stem}-", dir=into)
        except OSError as exc:
            raise ArchiveError(f"{path}: cannot unpack it into {into}: {exc.strerror or exc} (set "
                               "torchserve.unpack_dir to a folder the broker may write)") from None
        try:
            _extract(path, work)
            read(path, work)   # refused: nothing kept
            with open(os.path.join(work, ENTRY_FILE), "w") as f:
                f.write(ENTRY_TEXT)
            shutil.rmtree(dest, ignore_errors=True)
            os.rename(work, dest)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    return read(path, dest)


def _extract(path: str, dest: str) -> None:
    if os.path.isdir(path):
        shutil.copytree(path, dest, dirs_exist_ok=True, symlinks=False)
        return
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            for name in z.namelist():
                _inside(path, dest, name)
            z.extractall(dest)
        return
    if tarfile.is_tarfile(path):
        with tarfile.open(path) as t:
            members = [m for m in t.getmembers() if m.isfile() or m.isdir()]   # no links, devices
            for m in members:
                _inside(path, dest, m.name)
            t.extractall(dest, members=members, filter="data")
        # `-f tgz` puts the files under a folder named after the model
        tops = os.listdir(dest)
        if len(tops) == 1 and os.path.isdir(os.path.join(dest, tops[0])) and \
                os.path.exists(os.path.join(dest, tops[0], MANIFEST)):
            inner = os.path.join(dest, tops[0])
            for name in os.listdir(inner):
                os.rename(os.path.join(inner, name), os.path.join(dest, name))
            os.rmdir(inner)
        return
    raise ArchiveError(f"{path}: not a model archive (a .mar zip, a .tar.gz, or a folder with {MANIFEST})")


def _inside(path: str, dest: str, name: str) -> None:
    real = os.path.realpath(os.path.join(dest, name))
    if real != dest and not real.startswith(dest + os.sep):
        raise ArchiveError(f"{path}: member {name!r} would be written outside the archive's folder")


def read(source: str, folder: str) -> Archive:
    """The manifest (and model-config.yaml) of an unpacked archive, checked."""
    try:
        with open(os.path.join(folder, MANIFEST)) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise ArchiveError(f"{source}: no {MANIFEST} (not made by torch-model-archiver)") from None
    except (OSError, ValueError) as exc:
        raise ArchiveError(f"{source}: {MANIFEST} is not readable JSON: {exc}") from None
    model = manifest.get("model")
    if not isinstance(model, dict):
        raise ArchiveError(f"{source}: {MANIFEST} has no 'model' object")
    name, handler = model.get("modelName"), model.get("handler")
    if not name or not handler:
        raise ArchiveError(f"{source}: {MANIFEST} names no model.{'modelName' if not name else 'handler'}")
    runtime = manifest.get("runtime", "python")
    if runtime not in RUNTIMES:
        raise ArchiveError(f"{source}: runtime {runtime!r} is not served by tgw (only {', '.join(RUNTIMES)}: "
                           "tgw's workers run the handler in Python)")
    warnings = []
    for key in ("serializedFile", "modelFile", "configFile", "requirementsFile"):
        if model.get(key) and not os.path.exists(os.path.join(folder, model[key])):
            raise ArchiveError(f"{source}: model.{key} {model[key]!r} is not in the archive")
    if model.get("requirementsFile"):
        warnings.append(f"{source}: model.requirementsFile {model['requirementsFile']!r} is not installed by tgw: "
                        "install its packages into the workers' environment yourself")
    where = handler.split(":", 1)[0]
    if where.endswith(".py") and not os.path.exists(os.path.join(folder, os.path.basename(where))):
        raise ArchiveError(f"{source}: model.handler {handler!r}: the file is not in the archive")
    config = {}
    if model.get("configFile"):
        try:
            with open(os.path.join(folder, model["configFile"])) as f:
                config = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ArchiveError(f"{source}: model.configFile {model['configFile']!r}: {exc}") from None
        if not isinstance(config, dict):
            raise ArchiveError(f"{source}: model.configFile {model['configFile']!r} is not a mapping")
    version = str(model.get("modelVersion") or "1.0")
    return Archive(source=source, dir=folder, name=name, version=version, handler=handler,
                   manifest=manifest, config=config, warnings=tuple(warnings))


@dataclass(frozen=True)
class Registration:
    """What TorchServe's registration (or model-config.yaml) asks of batching and workers."""
    batch_size: int | None = None
    max_batch_delay_ms: int | None = None
    initial_workers: int | None = None
    response_timeout_s: int | None = None
    model_name: str | None = None     # the registration's model_name overrides the manifest's


def model_decl(archive: Archive, reg: Registration = Registration(), device: str = "cpu") -> dict:
    """The ModelDecl-shaped entry that serves `archive` as a stage (one request: one row)."""
    cfg = archive.config
    batch_size = reg.batch_size or int(cfg.get("batchSize") or 1)
    delay_ms = reg.max_batch_delay_ms if reg.max_batch_delay_ms is not None else \
        int(cfg.get("maxBatchDelay", DEFAULT_MAX_BATCH_DELAY_MS))
    timeout_s = reg.response_timeout_s or int(cfg.get("responseTimeout") or DEFAULT_RESPONSE_TIMEOUT_S)
    name = reg.model_name or archive.name
    return {
        "name": name,
        "versions": [{"version": archive.version, "handler": archive.entry}],
        "device": device,
        "inputs": [{"name": "request", "dtype": "bytes", "shape": []}],
        "outputs": [{"name": "response", "dtype": "bytes", "shape": []}],
        "max_batch_size": batch_size,
        "max_delay_us": delay_ms * 1000 if batch_size > 1 else 0,
        "timeout_ms": timeout_s * 1000,
        "options": {"torchserve": {"model_name": name, "batch_size": batch_size, "max_batch_delay": delay_ms,
                                   "url": os.path.basename(archive.source)}},
    }
