"""Log lines every tgw process writes the same way: the JSON record, the text line, and the
capture of whatever else the process writes to its file descriptors 1 and 2.

Capture (`capture_output`): a pipe is dup2'd over fd 1 and over fd 2, so what bypasses logging -
a handler's print(), torch's C++ warnings written straight to fd 2, a traceback Python prints -
reaches a reader thread, which logs each line as a record of logger "stdout" (INFO), "stderr"
(WARNING) or "torch" (torch's own "[W... file.cpp:12] ..." lines, at their level). The records
themselves go to a duplicate of the real stderr, returned for the log handler. A line that is
already a JSON object (a record of a worker, which inherits these pipes and captures its own
output the same way) is passed on as it is, never wrapped twice.
At exit the pipes are closed and read to their end, so nothing written before is lost; a
process killed by a signal loses what its reader had not read yet (the supervisor logs the
death, and faulthandler writes a fatal error's Python stack to the real stderr).

Standard library only: the broker and the workers both use it.
"""
from __future__ import annotations

import atexit
import faulthandler
import io
import json
import logging
import os
import re
import sys
import threading
import time

# a LogRecord's own attributes: everything else on a record came from `extra`
RECORD_KEYS = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}
# torch's own lines: c10's "[W1206 04:12:50.123456 file.cpp:12] msg" or "[W file.cpp:12] msg", and
# torch._logging's "W1206 04:16:17.787000 7529 torch/export/__init__.py:348] msg"
TORCH_LINE = re.compile(r"^\[?([WEIF])(?:\d{4} [\d:.]+(?: +\d+)? +| )?[\w./<>-]+:\d+\] ?(.*)$")
TORCH_LEVELS = {"W": logging.WARNING, "E": logging.ERROR, "I": logging.INFO, "F": logging.CRITICAL}
DRAIN_S = 2.0          # at exit, how long to wait for the readers to reach the end of their pipes


def torch_loggers() -> list[logging.Logger]:
    """torch's Python loggers as they are now ("torch" and every "torch.*" made so far): import
    torch first, which sets up their handlers."""
    names = ["torch", *(n for n in logging.root.manager.loggerDict if n.startswith("torch."))]
    return [logger for logger in map(logging.getLogger, names) if isinstance(logger, logging.Logger)]


def text_format(process: str) -> str:
    """The text line: time, level, process, logger, message."""
    return f"%(asctime)s %(levelname)s {process}[%(process)d] %(name)s: %(message)s"


class JsonRecord(logging.Formatter):
    """One JSON object per record: ts (ISO-8601, UTC), level, process, logger, msg, the `extra`
    fields, exc."""

    def __init__(self, process: str = ""):
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        line = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                + f".{int(record.msecs):03d}Z",
                "level": record.levelname, "logger": record.name, "msg": record.getMessage()}
        if self.process:
            line["process"] = self.process
        line.update((k, v) for k, v in vars(record).items() if k not in RECORD_KEYS and k not in line)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc"] = record.exc_text
        return json.dumps(line, default=str)


class _Reader(threading.Thread):
    """Reads one captured descriptor's pipe to its end, a record per line."""

    def __init__(self, fd: int, stream: str, out: io.TextIOBase):
        super().__init__(name=f"tgw-capture-{stream}", daemon=True)
        self.fd, self.out = fd, out
        self.stream = stream
        self.level = logging.INFO if stream == "stdout" else logging.WARNING

    def run(self) -> None:
        rest = b""
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            *lines, rest = (rest + chunk).split(b"\n")
            for raw in lines:
                self.line(raw)
        if rest:
            self.line(rest)
        os.close(self.fd)

    def line(self, raw: bytes) -> None:
        text = raw.decode("utf-8", "replace").rstrip("\r")
        if not text.strip():
            return
        if text.startswith("{") and text.endswith("}") and _is_record(text):
            self.out.write(text + "\n")   # a record already (a child's): passed on, not wrapped twice
            self.out.flush()
            return
        torch_line = TORCH_LINE.match(text)
        name, level = ("torch", TORCH_LEVELS[torch_line[1]]) if torch_line else (self.stream, self.level)
        record = logging.LogRecord(name, level, "", 0, "%s", (text,), None)
        # to the root's handlers only: a logger's own handler that writes to sys.stderr (torch
        # has one) would write the line back into the pipe, for ever
        for handler in logging.getLogger().handlers:
            if level >= handler.level:
                handler.handle(record)


def _is_record(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


class Capture:
    """The pipes over fds 1 and 2 and their readers; `real_stderr` is where records go."""

    def __init__(self) -> None:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        self.saved = {fd: os.dup(fd) for fd in (1, 2)}   # the real ones, not inherited by children
        self.real_stderr = open(os.dup(self.saved[2]), "w", encoding="utf-8", errors="replace",  # noqa: SIM115
                                buffering=1)
        self.readers = []
        for fd, stream in ((1, "stdout"), (2, "stderr")):
            r, w = os.pipe()
            os.dup2(w, fd)           # inheritable: a child that is not told otherwise writes here too
            os.close(w)
            reader = _Reader(r, stream, self.real_stderr)
            reader.start()
            self.readers.append(reader)
        if sys.stdout is not None:
            sys.stdout.reconfigure(line_buffering=True)   # a print reaches its record at once
        faulthandler.enable(file=self.real_stderr)
        logging.raiseExceptions = False   # a failing handler's report would come back through the pipe
        atexit.register(self.finish)

    def finish(self) -> None:
        """Close the pipes' write ends (the real descriptors back over 1 and 2) and let the
        readers log the last lines."""
        for stream in (sys.stdout, sys.stderr):
            try:
                if stream is not None:
                    stream.flush()
            except (OSError, ValueError):
                pass
        for fd, saved in self.saved.items():
            os.dup2(saved, fd)
        deadline = time.monotonic() + DRAIN_S
        for reader in self.readers:   # a child still holding a pipe keeps it open: wait no longer
            reader.join(max(0.0, deadline - time.monotonic()))
        self.real_stderr.flush()


_capture: Capture | None = None


def capture_output() -> io.TextIOBase:
    """Capture fds 1 and 2 (once a process); returns the real stderr, for the log handler."""
    global _capture
    if _capture is None:
        _capture = Capture()
    return _capture.real_stderr

