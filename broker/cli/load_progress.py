"""`tgw-broker models load` on a terminal: the load's phases while the request waits.

A thread asks the broker's `status` on a connection of its own every POLL_S and prints to
stderr each phase it has not printed yet, from `models[NAME]["loading"]`: a list of
{"version", "worker", "phase": "queued" | "loading" | "warming", "seconds"} (seconds so far); then "ready"
with the time the CLI waited once the answer came. Only when stderr is a terminal and --json is
not given; a broker whose status has no "loading" gives the final answer alone. A status that
fails is skipped: progress never fails the load.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Callable, Iterable, TextIO

from tgw.shm.wire import PROTOCOL_VERSION, Status

POLL_S = 0.25
STATUS_WAIT_S = 2.0


def wanted(args, stream: TextIO = sys.stderr) -> bool:
    return not args.json and stream.isatty()


def phase_lines(model: str, version: str, loading: Iterable[dict], seen: set) -> list[str]:
    """The lines of the phases of `model`:`version` not in `seen` (which they join), e.g.
    "m:2 loading on worker0[cpu] (0.3 s)"."""
    lines = []
    for entry in loading:
        if entry.get("version") != version:
            continue
        mark = (entry.get("worker"), entry.get("phase"))
        if mark in seen:
            continue
        seen.add(mark)
        lines.append(f"{model}:{version} {entry.get('phase', '?')} on {entry.get('worker', '?')} "
                     f"({float(entry.get('seconds') or 0):.1f} s)")
    return lines


def ready_line(model: str, version: str, seconds: float) -> str:
    return f"{model}:{version} ready after {duration(seconds)}"


def duration(seconds: float) -> str:
    """"1.2 s", or "12 ms" under a second."""
    return f"{seconds:.1f} s" if seconds >= 1 else f"{seconds * 1000:.0f} ms"


class Watch:
    """Prints the phases of one load while it is pending: `with Watch(...)` around the request."""

    def __init__(self, model: str, version: str, status: Callable[[], object], say: Callable[[str], None]):
        self.model, self.version, self.status, self.say = model, version, status, say
        self.seen: set = set()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="tgw-load-progress", daemon=True)
        self.t0 = time.monotonic()

    def __enter__(self) -> "Watch":
        self.thread.start()
        return self

    def __exit__(self, kind, exc, tb) -> None:
        self.done.set()
        self.thread.join()
        if kind is None:
            self.say(ready_line(self.model, self.version, time.monotonic() - self.t0))

    def _run(self) -> None:
        while not self.done.wait(POLL_S):
            try:
                models = self.status().models
            except Exception:   # progress is best-effort: the load's own answer says what happened
                continue
            loading = (models.get(self.model) or {}).get("loading") or []
            for line in phase_lines(self.model, self.version, loading, self.seen):
                self.say(line)


def watch(args, address: str, token: str | None, server_key: str | None) -> Watch:
    """A Watch of `models load`'s model and version, asking `status` at `address`."""
    from .ask import ask

    def status():
        return ask(address, Status(v=PROTOCOL_VERSION), STATUS_WAIT_S, token=token, server_key=server_key)

    def say(line: str) -> None:
        print(f"  {line}", file=sys.stderr, flush=True)
    return Watch(args.model, args.version, status, say)
