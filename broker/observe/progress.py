"""Loads as they move, one line per model per phase, for a person watching `tgw-broker start`:

      resnet:1 on worker0[cpu]  loading…
      resnet:1 on worker0[cpu]  warming up… (loaded in 11.1 s)
      resnet:1 on worker0[cpu]  ready in 12.3 s (load 11.1 s, warm-up 1.2 s)

Fed by the loader threads' messages (LoadPhase, ModelLoaded, WorkerFailed) as the core's
WorkerMessages reads them, the same events `status` shows as each model's `loading`; start-up
and run-time loads alike. On only where a person reads it: stderr is a terminal and the log
lines are text (JSON lines must stay parseable). TGW_PROGRESS=on (or 1) prints it anywhere,
TGW_PROGRESS=off (or 0) nowhere. Writing never fails the broker: a stream that cannot take a
line turns the printer off.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

from .logs import format_in_use

log = logging.getLogger("tgw.broker")
ENV = "TGW_PROGRESS"
FORCE_ON, FORCE_OFF = ("on", "1", "yes", "true"), ("off", "0", "no", "false")
ERROR_CHARS = 160   # of a failed load's error, its first line: the log has it whole


def wanted(stream: TextIO, setting: str | None, log_format: str) -> bool:
    """Whether to print: TGW_PROGRESS's `setting` when it forces it, else a terminal in text mode."""
    choice = (setting or "auto").strip().lower()
    if choice in FORCE_ON:
        return True
    if choice in FORCE_OFF:
        return False
    if choice != "auto":
        log.warning("%s=%r is not one of on, off, auto (or 1, 0): auto", ENV, setting)
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):   # no isatty, or closed
        tty = False
    return tty and log_format == "text"


def took(seconds: float) -> str:
    """A duration as a person reads it: "41 ms" under a second, else "12.3 s"."""
    return f"{max(seconds, 0) * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


class ProgressLines:
    def __init__(self, stream: TextIO, enabled: bool):
        self.stream, self.enabled = stream, enabled
        encoding = getattr(stream, "encoding", None) or "ascii"
        try:
            "…".encode(encoding)
            self.dots = "…"
        except (LookupError, UnicodeEncodeError):
            self.dots = "..."

    @classmethod
    def for_stderr(cls) -> "ProgressLines":
        """The broker's: on its stderr, as TGW_PROGRESS and the terminal decide."""
        return cls(sys.stderr, wanted(sys.stderr, os.environ.get(ENV), format_in_use()))

    def moved(self, worker: str, key: str, phase: str, seconds: float) -> None:
        """A load began ("loading") or its model is built and warms up ("warming", `seconds` in)."""
        if phase == "warming":
            self._line(worker, key, f"warming up{self.dots} (loaded in {took(seconds)})")
        else:
            self._line(worker, key, f"{phase}{self.dots}")

    def ready(self, worker: str, key: str, load_s: float, warm_s: float) -> None:
        self._line(worker, key, f"ready in {took(load_s + warm_s)} (load {took(load_s)}, warm-up {took(warm_s)})")

    def failed(self, worker: str, key: str, seconds: float | None, error: str) -> None:
        first = (error.strip().splitlines() or [""])[0]
        if len(first) > ERROR_CHARS:
            first = first[:ERROR_CHARS - 1] + self.dots
        after = f" after {took(seconds)}" if seconds is not None else ""
        self._line(worker, key, f"failed{after}: {first} (the log has the whole error)")

    def _line(self, worker: str, key: str, what: str) -> None:
        if not self.enabled:
            return
        try:
            self.stream.write(f"  {key} on {worker}  {what}\n")
            self.stream.flush()
        except (OSError, ValueError, UnicodeError):   # a closed terminal or pipe: nobody reads it any more
            self.enabled = False
