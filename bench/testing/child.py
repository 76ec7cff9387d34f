"""Subprocesses that the benchmarks and the tests start, and stop by their PID.

`Proc` runs a command in its own session (a Ctrl-C in the terminal reaches only the harness,
which then stops what it started, in order), its output in a log file; `stop()` sends SIGTERM,
and SIGKILL only if it is still alive after a grace period. An atexit hook stops any Proc still
running. `BrokerProc` (`python -m tgw.broker start` on a private ipc socket in a work folder) is
shared by the tests (tests/conftest.py) and the benchmarks.
"""
from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Callable, Optional

_LIVE: dict[int, "Proc"] = {}


class Proc:
    def __init__(self, argv: list[str], log_path: str, name: str):
        self.argv, self.log_path, self.name = argv, log_path, name
        self.proc: Optional[subprocess.Popen] = None

    def start(self, env: Optional[dict] = None) -> "Proc":
        with open(self.log_path, "ab") as log:  # the child keeps its own copy of the file
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **(env or {})}, start_new_session=True)
        _LIVE[self.proc.pid] = self
        return self

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def output(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def wait_for(self, pred: Callable[[], bool], timeout: float, what: str) -> None:
        """Poll pred() until it is true; raise with the log when the process exits or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode if self.proc else None} "
                                   f"while waiting for {what}:\n{self.output()[-4000:]}")
            try:
                if pred():
                    return
            except Exception:  # noqa: BLE001 - not there yet
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{self.name}: {what} not reached in {timeout:g}s:\n{self.output()[-4000:]}")

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM by PID, wait up to `timeout`, SIGKILL only if still alive; returns the exit status."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)  # not yet reaped, so the PID is still ours
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                print(f"[tgw] {self.name} (pid {self.proc.pid}) still running {timeout:g}s after SIGTERM: SIGKILL",
                      file=sys.stderr)
                self.proc.kill()
                self.proc.wait()
        _LIVE.pop(self.proc.pid, None)
        return self.proc.returncode


class BrokerProc(Proc):
    """A `tgw-broker start` subprocess: config, socket and log in `workdir`."""

    def __init__(self, config: dict, workdir: str):
        import yaml  # the broker parses YAML, so wherever one can start, yaml is installed
        self.dir = workdir
        self.address = f"ipc://{workdir}/s.sock"
        self.config_path = os.path.join(workdir, "config.yaml")
        # the config lives beside the socket in a short /tmp folder, away from the models it names:
        # unconfined unless it says otherwise (the lifecycle tests confine on purpose)
        config = {"model_roots": ["/"], **config}
        with open(self.config_path, "w") as f:
            yaml.safe_dump(config, f)
        super().__init__([], os.path.join(workdir, "broker.log"), "tgw broker")

    def start(self, wait: bool = True, timeout: float = 60.0, env: Optional[dict] = None,
              args: tuple[str, ...] = ()) -> "BrokerProc":
        """`args`: more `tgw-broker start` flags (e.g. --log-format json)."""
        # argv is made here: a caller may set another address (e.g. tcp://) before starting
        self.argv = [sys.executable, "-m", "tgw.broker", "start", "--config", self.config_path, "--address", self.address,
                     *args]
        super().start(env)
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 60.0) -> None:
        from tgw.client import Client

        def ready() -> bool:
            with Client(self.address, connect_timeout=1.0) as c:
                return bool(c.health()["ready"])
        self.wait_for(ready, timeout, f"ready at {self.address}")

    def worker_pids(self) -> list[int]:
        import psutil
        return [c.pid for c in psutil.Process(self.pid).children()]


@atexit.register
def stop_all() -> None:
    """Stop every Proc still running (by PID)."""
    for p in list(_LIVE.values()):
        p.stop(timeout=5)


def exit_record(broker: "BrokerProc") -> dict:
    """A benchmark's broker stopped: its exit status and any segment of its own left in /dev/shm;
    a status other than 0 also keeps its log's last lines (the work folder goes with the run)."""
    from tgw.shm.segment import list_segments
    record = {"exit_status": broker.stop(timeout=30), "shm_leftovers": list_segments(broker.pid)}
    if record["exit_status"] != 0:
        record["log_tail"] = broker.output().splitlines()[-40:]
    return record


def finish_run(work: str, keep: bool) -> None:
    """The end of a benchmark run: every server it started stopped, its work folder kept or removed."""
    stop_all()
    if keep:
        print(f"kept {work}", file=sys.stderr)
    else:
        shutil.rmtree(work, ignore_errors=True)
