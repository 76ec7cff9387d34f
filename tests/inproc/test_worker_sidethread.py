"""A worker side thread (loader, beacon) that raises ends the worker with its own status, so the
broker sees a death and starts a fresh one, instead of a live worker whose loads hang."""
from __future__ import annotations

import subprocess
import sys

from tgw.workers.sidethread import SIDE_THREAD_DIED

RAISING = """
import time, zmq
from tgw.workers.sidethread import SideThread

class Broken(SideThread):
    def _run(self):
        raise RuntimeError("a bug in the loader")

ctx = zmq.Context()
Broken(ctx, "inproc://nowhere", b"w", "tgw-loader").start()
time.sleep(30)   # the thread ends the process long before
print("still alive")
"""


def test_a_side_thread_that_raises_ends_the_worker_with_its_status():
    run = subprocess.run([sys.executable, "-c", RAISING], capture_output=True, text=True, timeout=60)
    assert run.returncode == SIDE_THREAD_DIED, (run.returncode, run.stdout, run.stderr)
    assert "still alive" not in run.stdout
    assert "tgw-loader died" in run.stderr and "a bug in the loader" in run.stderr, run.stderr
