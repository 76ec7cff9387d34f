"""What a failed load tells: a few lines for the operator (what failed, the likely cause, the
fix) and the whole traceback for the log, once.

`error_text(exc)` is the short text: the CLI's answer, WorkerFailed's and ModelLoaded's error.
`log_traceback(key, text, exc)` logs the traceback once, on the worker's one line about it.

Known causes: a torch.export file whose pytree types are registered by a module the worker has
not imported (torch.export.load then says only "check the warnings above"; the real cause is
in a warning that torch logs, kept here by `watch_torch_warnings`), a custom operator not
loaded, a missing file, a TorchScript file saved by a newer torch, a file of another format,
out of memory.
"""
from __future__ import annotations

import logging
import re
import sys
import threading
import time
from collections import deque

from tgw.shm.log_lines import torch_loggers

log = logging.getLogger("tgw.worker")
MAX_ERROR_CHARS = 4000
HEADLINE_CHARS = 300
SHORT_LINES = 3       # a message this short is told whole
RECENT_S = 120.0      # a torch warning older than this is not taken as a load's cause
NOT_REGISTERED = re.compile(r"Deserializing ([\w.]+) in pytree is not registered")
NO_OPERATOR = re.compile(r"(?:Could not find schema for|No such operator|Unknown builtin op:)\s*([\w.:]*\w)")   # the name, not the sentence's full stop
NEWER_TORCH = ("maximum supported version", "may be too old", "Unknown type name", "kMaxSupportedFileFormatVersion",
               "Unknown builtin op")
NOT_A_MODEL = ("failed finding central directory", "invalid load key", "not a zip archive", "PytorchStreamReader")


class _RecentWarnings(logging.Handler):
    """Torch's warnings of the last RECENT_S seconds, per thread (a load runs on one thread)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.local = threading.local()

    def emit(self, record: logging.LogRecord) -> None:
        kept = getattr(self.local, "kept", None)
        if kept is None:
            kept = self.local.kept = deque(maxlen=8)
        kept.append(record)

    def texts(self) -> list[str]:
        """This thread's recent warnings (message and exception chain), then forgotten."""
        kept, now = getattr(self.local, "kept", None) or (), time.time()
        texts = [record.getMessage() + "\n" + _chain(record.exc_info[1] if record.exc_info else None)
                 for record in kept if now - record.created < RECENT_S]
        if kept:
            kept.clear()
        return texts


_recent = _RecentWarnings()


def watch_torch_warnings() -> None:
    """Keep torch's warnings, for `error_text` to find a load's cause in (once a process)."""
    import torch  # noqa: F401  first: its import resets the handlers of its loggers
    # torch's loggers that keep their records to themselves (torch, torch.export, ...)
    for torch_log in torch_loggers():
        if (torch_log.name == "torch" or not torch_log.propagate) and _recent not in torch_log.handlers:
            torch_log.addHandler(_recent)


def _chain(exc: BaseException | None) -> str:
    """The messages of `exc` and of its causes and contexts."""
    parts, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        parts.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    return "\n".join(parts)


def headline(exc: BaseException) -> str:
    """What failed: a short message whole (SHORT_LINES lines at most); of a long one its first
    line, or for a TorchScript error its last (the error itself, after TorchScript's traceback)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    if len(lines) <= SHORT_LINES and sum(map(len, lines)) <= 2 * HEADLINE_CHARS:
        return f"{type(exc).__name__}: " + "\n".join(lines)
    line = lines[-1] if len(lines) > 1 and "TorchScript" in lines[0] else lines[0]
    more = f" (+{len(lines) - 1} line(s) in the worker's log)" if len(lines) > 1 else ""
    text = line if line.startswith(type(exc).__name__) else f"{type(exc).__name__}: {line}"
    return (text[:HEADLINE_CHARS] + ("..." if len(text) > HEADLINE_CHARS else "")) + more


def diagnosis(exc: BaseException, warnings: list[str] = ()) -> tuple[str, str] | None:
    """(likely cause, fix) for the failures tgw knows, else None."""
    text = "\n".join([_chain(exc), *warnings])
    missing_type = NOT_REGISTERED.search(text)
    if missing_type:
        name = missing_type[1]
        module = name.rsplit(".", 1)[0] if "." in name else name
        return (f"the file uses the type {name}, which module {module} registers with torch's pytree, and the "
                "worker has not imported it",
                f"add it to the worker's imports: workers.preload: [{module}]")
    operator = NO_OPERATOR.search(text)
    if operator and "::" in operator[1]:
        namespace = operator[1].split("::")[0]
        return (f"the file calls the operator {operator[1]}, which nothing the worker loaded registers",
                f"add the module or .so that registers the {namespace} operators to workers.preload")
    if isinstance(exc, FileNotFoundError) or "No such file" in text:
        return ("the model file is not there (moved, deleted, or a path relative to another folder)",
                "check the version's path: a relative path is resolved against the config file's folder")
    if any(s in text for s in NEWER_TORCH):
        torch = sys.modules.get("torch")
        ours = f" ({torch.__version__})" if torch is not None else ""
        return (f"the file was saved by a newer torch than the worker's{ours}",
                "save it again with the worker's torch version (or older), or upgrade the worker's torch")
    if type(exc).__name__ == "FormatMismatch":   # a program against its declaration: its message says the fix
        return None
    if type(exc).__name__ == "ModelFormatError" or any(s in text for s in NOT_A_MODEL):
        return ("the file is not a model of the declared format (another format, or truncated)",
                "set the version's format: to what the file holds, or save the file again")
    if type(exc).__name__ == "OutOfMemoryError" or isinstance(exc, MemoryError):
        return ("the device ran out of memory while loading",
                "free room on it: fewer models there, residency: on_demand, or another device")
    if "check the warnings above" in text:
        return ("torch could not read the file; its reason is in the worker's log, above the traceback",
                "if it names a type that is not registered, add its module to workers.preload")
    return None


def error_text(exc: BaseException) -> str:
    """The short text of a failed load: what failed; the likely cause and the fix when known."""
    lines = [headline(exc)]
    known = diagnosis(exc, _recent.texts())
    if known is not None:
        lines += [f"cause: {known[0]}", f"fix: {known[1]}"]
    return "\n".join(lines)[:MAX_ERROR_CHARS]


def log_traceback(key: str, text: str, exc: BaseException | None, reason: str | None = None) -> None:
    """The worker's one line of a failed load, with its whole traceback: the broker logs only
    the short text, so the traceback is in the log once."""
    log.warning("load of %s failed%s: %s", key, f" ({reason})" if reason else "", one_line(text),
                exc_info=(type(exc), exc, exc.__traceback__) if exc is not None else None,
                extra={"event": "model_load_traceback", "key": key})


def one_line(text: str) -> str:
    """A short text on one log line."""
    return text.replace("\n", "; ")
