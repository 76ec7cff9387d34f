"""Where model files may come from, and whether a file is the one declared (and of its format).

Used by config validation and by loads an operator asks for at run time, so nothing here
depends on the schema: a path is confined to the model_roots folders, then checked.
"""
from __future__ import annotations

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
