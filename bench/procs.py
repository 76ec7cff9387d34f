"""Processes the harness starts (brokers, gunicorn, echo servers): started in their own session
(so a Ctrl-C in the terminal reaches only the harness), stopped by PID - SIGTERM, then SIGKILL
after a grace period - from `finally` blocks and from an atexit hook as a last resort.
"""
from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import time
from typing import Optional

_LIVE: dict[int, "Managed"] = {}


class Managed:
    def __init__(self, argv: list[str], name: str, log_path: Optional[str] = None,
                 env: Optional[dict] = None, cwd: Optional[str] = None):
        self.name, self.argv, self.log_path = name, argv, log_path
        self._log = open(log_path, "ab") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, cwd=cwd, start_new_session=True)
        self.pid = self.proc.pid
        _LIVE[self.pid] = self

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 30) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, "rb") as f:
            return "\n".join(f.read().decode(errors="replace").splitlines()[-n:])

    def stop(self, grace: float = 15.0) -> Optional[int]:
        """SIGTERM the PID, wait, SIGKILL if needed; returns the exit status."""
        if self.alive():
            try:
                os.kill(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                print(f"[bench] {self.name} (pid {self.pid}) ignored SIGTERM for {grace}s; SIGKILL",
                      file=sys.stderr)
                try:
                    os.kill(self.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(10)
        _LIVE.pop(self.pid, None)
        if self._log is not subprocess.DEVNULL:
            self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "Managed":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def wait_until(pred, timeout: float, what: str, proc: Optional[Managed] = None, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            raise RuntimeError(f"{proc.name} exited with status {proc.proc.returncode} while waiting for "
                               f"{what}; log tail:\n{proc.log_tail()}")
        try:
            if pred():
                return
        except Exception:  # noqa: BLE001 - not ready yet
            pass
        time.sleep(interval)
    tail = f"; log tail:\n{proc.log_tail()}" if proc else ""
    raise RuntimeError(f"timed out after {timeout}s waiting for {what}{tail}")


def stop_all() -> None:
    for m in list(_LIVE.values()):
        m.stop(grace=5)


def sigterm_as_interrupt() -> None:
    """Make SIGTERM unwind like Ctrl-C, so `finally` blocks stop what was started."""
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, handler)


atexit.register(stop_all)
