"""The worker doorbell (shm/doorbell.py, workers.doorbell): a real worker process on a lane says
hello there and exits at its broker's EOF; a broker on the ZeroMQ fallback serves, and sees a
killed worker, restarts it and serves again. (The default, the lanes, runs under every other
process test.)"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import psutil

from conftest import base_config, wait_until
from tgw.client import Client
from tgw.shm import doorbell
from tgw.shm.segment import Segment, new_name
from tgw.shm.wire import WorkerHello, from_worker_decoder
from tgw.shm.wire_start import WorkerStart, encode_start

X = np.zeros((1, 256), np.float32)


def test_a_worker_says_hello_on_its_lane_and_exits_when_the_broker_end_closes(short_dir):
    segment = Segment.create(new_name("ring"), 2 << 20)
    mine, theirs = doorbell.pair()
    try:
        start = WorkerStart(worker_id=0, identity="w0.1", segment=segment.name, input_bytes=1 << 20,
                            output_bytes=1 << 20, endpoint=f"ipc://{short_dir}/back", lane_fd=theirs.fileno())
        proc = subprocess.Popen([sys.executable, "-m", "tgw.workers", encode_start(start)],
                                stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, pass_fds=(theirs.fileno(),))
        theirs.close()
        lane = doorbell.Lane(mine)
        assert lane.poll(120_000), "no hello on the lane"   # fails rather than hangs
        hello = from_worker_decoder.decode(lane.recv())   # not on the ZeroMQ endpoint: nothing listens there
        assert isinstance(hello, WorkerHello) and hello.pid == proc.pid
        lane.close()   # the broker is gone: the worker, waiting for its load message, reads EOF
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 1 and "the broker closed its lane" in err and "Traceback" not in err, err
    finally:
        segment.close()
        segment.unlink()


def test_the_zmq_fallback_serves_and_restarts_a_killed_worker(model_files, make_broker):
    workers = {"devices": ["cpu"], "threads_per_worker": 1, "input_arena_mb": 8, "output_arena_mb": 4, "doorbell": "zmq"}
    b = make_broker(base_config(model_files, "mlp", workers=workers))
    with Client(b.address) as c:
        assert c.infer("mlp", {"x": X})["y"].shape == (1, 10)
        old = b.worker_pids()[0]
        assert "lane_fd" not in " ".join(psutil.Process(old).cmdline())   # no lane: its DEALER serves
        os.kill(old, signal.SIGKILL)
        wait_until(lambda: old not in (pids := b.worker_pids()) and pids, 60, "the worker's restart")
        assert c.infer("mlp", {"x": X}, timeout=60)["y"].shape == (1, 10)   # on the restarted worker
    assert b.worker_pids() and b.worker_pids()[0] != old
