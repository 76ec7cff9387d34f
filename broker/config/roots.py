"""Where model files may come from, and whether a file is the one declared (and of its format).

Used by config validation and by loads an operator asks for at run time, so nothing here
depends on the schema: a path is confined to the model_roots folders, then checked.
"""
from __future__ import annotations

import ast
import hashlib
import os
import stat
from typing import Optional

from tgw.shm.model_format import ModelFormatError, detect


class PathRefused(ValueError):
    """A model path outside model_roots, or one that could be read as pointing elsewhere."""


class ModelFileError(ValueError):
    """A model file that is missing, not a regular file, not the one its sha256 names, or not
    of the format declared."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field   # the version key the problem is about: "path", "sha256" or "format"


def _inside(path: str, root: str) -> bool:
    # by whole components: /models2/a.pt is not inside /models
    return os.path.commonpath([path, root]) == root


def confine(path: str, roots: list[str]) -> str:
    """The real path (symlinks resolved) of an absolute model path that lies inside one of
    `roots`; the caller loads that real path, so a symlink swapped later cannot redirect it."""
    if not os.path.isabs(path):
        raise PathRefused(f"{path} must be absolute")
    if ".." in path.split(os.sep):
        raise PathRefused(f"{path} contains '..'")
    real, real_roots = os.path.realpath(path), [os.path.realpath(r) for r in roots]
    if any(_inside(real, r) for r in real_roots):
        return real
    listed = f"model_roots [{', '.join(roots)}]"
    if any(_inside(os.path.normpath(path), os.path.abspath(r)) for r in roots + real_roots):
        raise PathRefused(f"{path} is a symlink that resolves to {real}, outside {listed}")
    raise PathRefused(f"{path} is outside {listed}")


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_file(path: str, sha256: Optional[str], fmt: Optional[str] = None) -> str:
    """The file's format (`fmt`, or detected when None); ModelFileError unless `path` is a regular
    file whose sha256 (when given) matches and that holds a servable model of that format."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise ModelFileError(f"not a regular file: {path}", "path")
        actual = file_sha256(path) if sha256 is not None else None
    except (FileNotFoundError, NotADirectoryError):
        raise ModelFileError(f"model file not found: {path}", "path") from None
    except OSError as exc:
        raise ModelFileError(f"cannot read model file {path}: {exc.strerror}", "path") from None
    if actual != sha256:
        raise ModelFileError(f"sha256 does not match {path} (sha256 {actual})", "sha256")
    try:
        return detect(path, fmt)
    except ModelFormatError as exc:
        raise ModelFileError(str(exc), "format" if fmt else "path") from None
    except OSError as exc:
        raise ModelFileError(f"cannot read model file {path}: {exc.strerror}", "path") from None


def split_handler(handler: str) -> tuple[str, str]:
    """("file.py" or "package.module", "Class") of a stage's handler."""
    where, _, cls = handler.rpartition(":")
    return where, cls


def check_handler_file(path: str, sha256: Optional[str], cls: str) -> None:
    """ModelFileError (field "handler" or "sha256") unless `path` is a regular Python file whose
    sha256 (when given) matches and that defines `cls` at its top level. The file is parsed,
    never run: the broker runs no stage code."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise ModelFileError(f"not a regular file: {path}", "handler")
        with open(path, "rb") as f:
            source = f.read()
    except (FileNotFoundError, NotADirectoryError):
        raise ModelFileError(f"handler file not found: {path}", "handler") from None
    except OSError as exc:
        raise ModelFileError(f"cannot read handler file {path}: {exc.strerror}", "handler") from None
    actual = hashlib.sha256(source).hexdigest()
    if sha256 is not None and actual != sha256:
        raise ModelFileError(f"sha256 does not match {path} (sha256 {actual})", "sha256")
    try:
        tree = ast.parse(source, filename=path)
    except (SyntaxError, ValueError) as exc:   # ValueError: a null byte
        why = f"line {exc.lineno}: {exc.msg}" if isinstance(exc, SyntaxError) else str(exc)
        raise ModelFileError(f"handler file {path} is not valid Python ({why})", "handler") from None
    if cls not in _top_level_names(tree):
        raise ModelFileError(f"handler file {path} defines no {cls!r} at its top level", "handler")


def _top_level_names(tree: ast.Module) -> set[str]:
    """Names a module binds at its top level: classes, functions, assignments, imports."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names
