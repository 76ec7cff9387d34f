"""An output's label file for the classification extension (Triton's label_filename): one label
a line, line k naming class k. The config check refuses a file that is missing or unreadable;
the broker reads it at each load and reload (models/entry.py), so an edited file takes effect
with the next reload.
"""
from __future__ import annotations

MAX_LABEL_BYTES = 64 << 20   # a label file is text; anything larger is a mistake


class LabelFileError(ValueError):
    """A label file that cannot serve: missing, unreadable, not UTF-8 or too large."""


def read_labels(path: str) -> list[str]:
    """The labels of `path`, one a line (a trailing newline ends the last; none is dropped)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_LABEL_BYTES + 1)
    except OSError as exc:
        raise LabelFileError(f"label file {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_LABEL_BYTES:
        raise LabelFileError(f"label file {path} is over {MAX_LABEL_BYTES >> 20} MiB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LabelFileError(f"label file {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]
