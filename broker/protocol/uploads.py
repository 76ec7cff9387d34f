"""Triton's repository load with a config override and model files (docs/HTTP.md, "Load with a
config and files"): the `config` parameter (Triton's model config as JSON) and `file:<path>`
parameters (the file's bytes: base64 text over HTTP, bytes over gRPC), turned into a tgw model
entry the operator serves (models/reload.py's override).

Off unless `server.allow_model_uploads` (which needs server.auth_token_file, so every request that
reaches here presented the token). The files form a new model folder under the first of
model_roots (`<root>/uploads/<model>.<n>/<model>/`), never outside: each path is relative, without `..`
or an empty component, and is created in a folder made fresh for this load (no symlink can be in
it), each file opened with O_EXCL | O_NOFOLLOW. A config without files keeps the model's own folder
(its versions' files, from its repository); files without a config are refused, as Triton refuses
them. The config is read and mapped by tgw.broker.triton_repo, as a repository's config.pbtxt is.
"""
from __future__ import annotations

import base64
import binascii
import os
import posixpath
import re
import shutil
from typing import NamedTuple

from tgw.shm.errors import Code, TgwError, fail

UPLOADS = "uploads"           # the folder under the first model root
FILE_PREFIX = "file:"
MAX_FILES = 1024
NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")   # a model's folder name: no path in it


class Upload(NamedTuple):
    """What a load's parameters ask: the config's JSON text (None: none) and the files."""
    config: str | None
    files: dict[str, bytes]


def failed(model: str, why: str, code: Code = Code.INVALID_ARGUMENT, reason: str = "load_refused",
           **details) -> TgwError:
    """A refused load, worded as Triton's ("failed to load 'm', ...": its clients match that)."""
    return fail(code, f"failed to load '{model}', {why}", model=model, reason=reason, **details)


def split(model: str, params: dict) -> tuple[Upload | None, dict]:
    """The config and files of a load's parameters (None: it has neither), and the rest."""
    rest = {k: v for k, v in params.items() if k != "config" and not k.startswith(FILE_PREFIX)}
    if len(rest) == len(params):
        return None, rest
    config = params.get("config")
    if config is not None and not isinstance(config, str):
        raise failed(model, f"parameter config must be the model config as JSON text, got {type(config).__name__}")
    files = {}
    for key, value in params.items():
        if key.startswith(FILE_PREFIX):
            files[relative(model, key)] = content(model, key, value)
    if len(files) > MAX_FILES:
        raise failed(model, f"{len(files)} files sent; at most {MAX_FILES}")
    return Upload(config, files), rest


def relative(model: str, key: str) -> str:
    """The path a `file:` parameter names, inside the model's folder: relative, normal, no '..'."""
    path = key[len(FILE_PREFIX):]
    parts = path.split("/")
    if not path or path.startswith("/") or "\\" in path or "\0" in path or \
            any(p in ("", ".", "..") for p in parts) or posixpath.normpath(path) != path:
        raise failed(model, f"parameter {key!r}: a file's path is relative to the model's folder, without '..', "
                     "'.', empty components or backslashes (e.g. file:1/model.pt)", parameter=key)
    return path


def content(model: str, key: str, value) -> bytes:
    """A file's bytes: gRPC's bytes_param as it came, HTTP's base64 text decoded."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, str):
        try:
            return base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise failed(model, f"parameter {key!r} is not base64 (a file's bytes over HTTP are base64 text)",
                         parameter=key) from None
    raise failed(model, f"parameter {key!r} must be the file's bytes (base64 text over HTTP), got "
                 f"{type(value).__name__}", parameter=key)


class Uploads:
    """Where uploaded model folders go, and how many were made (each load its own folder)."""

    def __init__(self, root: str):
        """`root`: the first of model_roots (a real path)."""
        self.base = os.path.join(os.path.realpath(root), UPLOADS)
        self.made = 0

    def write(self, model: str, files: dict[str, bytes]) -> str:
        """A fresh model folder holding `files`, <base>/<model>.<n>/<model> (Triton's repository
        reader wants the model's name as its folder's); its path."""
        if not NAME.fullmatch(model):
            raise failed(model, "a model loaded with files needs a name of letters, digits, '_', '-' and '.' "
                         "(not first), at most 128")
        os.makedirs(self.base, mode=0o700, exist_ok=True)
        if os.path.islink(self.base) or not os.path.isdir(self.base):
            raise failed(model, f"{self.base} is not a folder of model_roots", Code.INTERNAL)
        while True:
            self.made += 1
            top = os.path.join(self.base, f"{model}.{self.made}")
            try:
                os.mkdir(top, 0o700)
                break
            except FileExistsError:   # a folder of an earlier run: never written into
                continue
        folder = os.path.join(top, model)
        try:
            os.mkdir(folder, 0o700)
            for rel, data in files.items():
                self._write_one(folder, rel, data)
        except OSError as exc:   # e.g. file:1 and file:1/model.pt both sent
            shutil.rmtree(top, ignore_errors=True)
            raise failed(model, f"cannot write its files: {exc.strerror}: {exc.filename}") from None
        except BaseException:
            shutil.rmtree(top, ignore_errors=True)
            raise
        return folder

    def folder_of(self, paths: list) -> str | None:
        """The uploaded model folder a model's version files lie in (None: not an uploaded model)."""
        folders = {tuple(os.path.relpath(p, self.base).split(os.sep)[:2]) for p in paths
                   if p and os.path.commonpath([p, self.base]) == self.base}
        return os.path.join(self.base, *folders.pop()) if len(folders) == 1 else None

    def discard(self, folder: str) -> None:
        """An uploaded model folder no longer served (its load failed, or it was replaced): gone
        with the <model>.<n> folder that holds it."""
        top = os.path.dirname(folder)
        if os.path.dirname(top) == self.base:
            shutil.rmtree(top, ignore_errors=True)

    @staticmethod
    def _write_one(folder: str, rel: str, data: bytes) -> None:
        path = os.path.join(folder, *rel.split("/"))
        if os.path.commonpath([os.path.realpath(os.path.dirname(path)), folder]) != folder:
            raise failed(os.path.basename(folder), f"file {rel!r} would lie outside its model folder")
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)


def version_files(versions) -> list[str]:
    """Each version's file: a model's path, a stage's handler file ("/abs/file.py:Class")."""
    return [v.path or (v.handler.rsplit(":", 1)[0] if v.handler and v.handler.startswith("/") else "")
            for v in versions]


def model_folder(model: str, paths: list[str]) -> str:
    """The repository folder of a served model (its versions' files lie in <folder>/<version>/),
    for a config override without files; refused when its files do not lie so."""
    folders = {os.path.dirname(os.path.dirname(p)) for p in paths if p}
    if len(folders) != 1 or not all(os.path.basename(os.path.dirname(p)).isdecimal() for p in paths if p):
        raise failed(model, "failed to poll from model repository: a config override without files needs a model "
                     "from a Triton repository (its files in <model>/<version>/); send the files too (file:1/...)")
    return folders.pop()


def translate(model: str, config_text: str, folder: str) -> tuple[dict, list[str]]:
    """The tgw model entry (a ModelDecl-shaped dict) for Triton config `config_text` over the
    files of `folder`, and the translation's warnings; its refusals refuse the load."""
    try:
        from tgw.broker.triton_repo import config_from_json, translate_model
    except ImportError:   # the module arrives with the Triton repository support
        raise failed(model, "this broker cannot read Triton model configs (tgw.broker.triton_repo is missing)",
                     Code.INTERNAL) from None
    try:
        config = config_from_json(config_text)
    except Exception as exc:   # json_format's ParseError, ValueError: the message names the field
        raise failed(model, f"parameter config is not a Triton model config in JSON: {exc}") from None
    if config.name and config.name != model:
        raise failed(model, f"the config override names model {config.name!r}; load it as {config.name!r}, or "
                     f"name it {model!r}")
    config.name = model
    translation = translate_model(config, folder)
    if translation.refusals:
        raise failed(model, "; ".join(translation.refusals), refusals=translation.refusals)
    if translation.pipelines or len(translation.models) != 1:
        raise failed(model, "a config override loads one model; an ensemble is a pipeline of the broker's config "
                     "or repository")
    return translation.models[0], list(translation.warnings)
