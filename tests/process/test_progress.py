"""Progress on long loads (issue 39, point 3), with a real broker and worker: one worker holds a
fast stage and a slow one whose setup waits for a file the test creates. The fast one answers
while the slow one still loads, `status` shows the slow one loading, and on a terminal (a
pseudo-terminal as the broker's stderr) each phase is printed; in a pipe, none is."""
from __future__ import annotations

import os
import pty
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

from conftest import wait_until
from stages import X_IN, Y_OUT
from tgw.client import Client

HANDLERS = '''
import os
import time

from tgw.workers.stage import Stage


class AddOne(Stage):
    def __call__(self, batch):
        return {"y": batch["x"] + 1}


class Gated(AddOne):
    """A slow load the test ends: setup waits until the file options["gate"] exists."""

    def setup(self, context):
        while not os.path.exists(context.options["gate"]):
            time.sleep(0.02)
'''
WORKER = "worker0[cpu]"


def config(d: str) -> dict:
    with open(os.path.join(d, "handlers.py"), "w") as f:
        f.write(HANDLERS)
    stage = {"inputs": X_IN, "outputs": Y_OUT, "max_batch_size": 4}
    return {"model_roots": [d],
            "workers": {"devices": ["cpu"], "threads_per_worker": 1, "input_arena_mb": 4, "output_arena_mb": 2},
            "models": [{"name": "fast", "versions": [{"version": "1", "handler": "handlers.py:AddOne"}], **stage},
                       {"name": "slow", "versions": [{"version": "1", "handler": "handlers.py:Gated"}],
                        "options": {"gate": os.path.join(d, "gate")}, **stage}]}


class Broker:
    """`tgw-broker start` with its stderr on a pseudo-terminal (`tty`) or a pipe, read by a thread."""

    def __init__(self, d: str, tty: bool):
        import yaml
        self.address = f"ipc://{d}/s.sock"
        path = os.path.join(d, "config.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(config(d), f)
        env = {k: v for k, v in os.environ.items() if k != "TGW_PROGRESS"}   # the terminal decides
        if tty:
            self.out, writer = pty.openpty()
        else:
            self.out, writer = os.pipe()
        self.proc = subprocess.Popen([sys.executable, "-m", "tgw.broker", "start", "--config", path,
                                      "--address", self.address], stdin=subprocess.DEVNULL, stdout=writer,
                                     stderr=writer, env=env, start_new_session=True)
        os.close(writer)
        self.text = ""
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.out, 4096)
            except OSError:   # EIO: the pty's last writer closed
                return
            if not chunk:
                return
            self.text += chunk.decode(errors="replace").replace("\r\n", "\n")

    def printed(self, line: str) -> str:
        return wait_until(lambda: line in self.text or self.proc.poll() is not None, 60, line) and \
            self._alive_with(line)

    def _alive_with(self, line: str) -> str:
        assert line in self.text, f"broker exited {self.proc.returncode} before printing {line!r}:\n{self.text}"
        return line

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        code = self.proc.wait(60)
        self.reader.join(30)
        os.close(self.out)
        return code


@pytest.fixture
def started(short_dir):
    brokers: list[Broker] = []

    def start(tty: bool) -> Broker:
        brokers.append(Broker(short_dir, tty))
        return brokers[-1]

    yield start
    for b in brokers:
        if b.proc.poll() is None:
            b.stop()


def test_a_fast_model_serves_while_a_slow_one_loads_and_a_terminal_shows_each_phase(started, short_dir):
    b = started(tty=True)
    b.printed(f"  fast:1 on {WORKER}  ready in ")
    b.printed(f"  slow:1 on {WORKER}  loading")
    with Client(b.address) as c:
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        np.testing.assert_array_equal(c.infer("fast", {"x": x})["y"], x + 1)
        status = c.status()
        assert status["phase"] == "starting" and not c.health()["ready"]   # ready means every model
        fast, slow = status["models"]["fast"], status["models"]["slow"]
        assert fast["ready"] and fast["loading"] == []
        assert not slow["ready"]
        [load] = slow["loading"]
        assert (load["version"], load["worker"], load["phase"]) == ("1", WORKER, "loading")
        assert load["seconds"] >= 0
        open(os.path.join(short_dir, "gate"), "w").close()   # the slow setup ends
        b.printed(f"  slow:1 on {WORKER}  warming up")
        b.printed(f"  slow:1 on {WORKER}  ready in ")
        wait_until(lambda: c.health()["ready"], 60, "every model ready")
        assert c.status()["models"]["slow"]["loading"] == []
        np.testing.assert_array_equal(c.infer("slow", {"x": x})["y"], x + 1)
    assert f"  fast:1 on {WORKER}  loading" in b.text and f"  fast:1 on {WORKER}  warming up" in b.text
    assert b.stop() == 0, b.text


def test_no_progress_lines_in_a_pipe(started, short_dir):
    open(os.path.join(short_dir, "gate"), "w").close()   # nothing waits
    b = started(tty=False)
    b.printed(f"{WORKER} loaded slow:1 in ")   # the log says it, in its own lines
    with Client(b.address) as c:
        wait_until(lambda: c.health()["ready"], 60, "every model ready")
    assert b.stop() == 0, b.text
    assert " on worker0[cpu]  " not in b.text and "ready in" not in b.text, b.text
