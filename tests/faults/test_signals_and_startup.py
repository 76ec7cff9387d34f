"""Signals and the ways out of a start: SIGTERM right after a worker death, SIGHUP (a reload), a
start refused for lack of /dev/shm, a socket directory others may write. Every admitted request gets one
answer; every way out removes the segments and socket files it made and prints no traceback."""
from __future__ import annotations

import os
import signal
import stat
import threading

import numpy as np
import pytest

from conftest import base_config, wait_until
from tally import Tally, row
from tgw.client import Client
from tgw.shm.paths import ipc_path
from tgw.shm.segment import free_bytes, list_segments

TWO_WORKERS = {"devices": ["cpu", "cpu"], "threads_per_worker": 1, "input_arena_mb": 4, "output_arena_mb": 2}


def no_leftovers(b) -> bool:
    path = ipc_path(b.address)
    return list_segments(b.proc.pid) == [] and not os.path.exists(path) and \
        not any(n.endswith(".w.sock") for n in os.listdir(os.path.dirname(path)))


@pytest.mark.parametrize("devices", [["cpu", "cpu"], ["cpu"]], ids=["two workers", "its only worker"])
def test_sigterm_right_after_a_worker_death_answers_everything(model_files, make_broker, devices):
    """No restarts while stopping: what no live worker can run is answered at once, not after
    the grace (300 s here: far past the callers' own wait)."""
    b = make_broker(base_config(model_files, "spin", workers={**TWO_WORKERS, "devices": devices},
                                supervisor={"shutdown_grace_s": 300}, spin={"max_batch_size": 1}))
    callers = 16
    t = Tally(f"worker SIGKILL, SIGTERM: {len(devices)} worker(s)")
    with Client(b.address) as c:
        baseline = c.stats()["models"]["spin"]["requests"]
        threads = [threading.Thread(target=t.call, args=(c.infer, "spin", {"x": np.full((1, 1), 150, np.float32)}),
                                    kwargs={"timeout": 60}) for _ in range(callers)]
        for th in threads:
            th.start()
        wait_until(lambda: c.stats()["models"]["spin"]["requests"] - baseline == callers, 60, "all to be admitted")
        os.kill(c.status()["workers"][0]["pid"], signal.SIGKILL)
        b.proc.send_signal(signal.SIGTERM)
        for th in threads:
            th.join(120)
    assert b.proc.wait(60) == 0
    row(t, f"broker exit {b.proc.returncode}")
    assert t.sent == callers and t.unanswered == 0
    assert set(t.counts) <= {"ok", "WORKER_DIED", "MODEL_NOT_READY"}
    assert "Traceback" not in b.output() and no_leftovers(b)


def test_sighup_with_an_unchanged_config_reloads_nothing_and_serves_on(model_files, make_broker):
    b = make_broker(base_config(model_files, "mlp"))
    with Client(b.address) as c:
        b.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "no changes" in b.output(), 30, "the reload's log line")
        assert c.infer("mlp", {"x": np.ones((1, 256), np.float32)})["y"].shape == (1, 10)
        assert c.status()["reload"]["ok"] is True
    assert b.alive()


def test_start_refused_for_lack_of_shm_leaves_nothing_behind(model_files, make_broker):
    workers = free_bytes() // (65536 << 20) + 1    # each ring 64 GiB: more than /dev/shm holds
    b = make_broker(base_config(model_files, "mlp", workers={"devices": ["cpu"] * workers,
                                                             "input_arena_mb": 65536}), start=False)
    b.start(wait=False)
    assert b.proc.wait(60) == 1
    out = b.output()
    assert "start-up failed" in out and "/dev/shm" in out and "Traceback" not in out
    assert no_leftovers(b)


def test_socket_directory_others_may_write_is_refused_and_left_as_it_is(model_files, make_broker, short_dir):
    sock_dir = os.path.join(short_dir, "open")
    os.mkdir(sock_dir)
    os.chmod(sock_dir, 0o777)
    b = make_broker(base_config(model_files, "mlp"), start=False)
    b.address = f"ipc://{sock_dir}/s.sock"
    b.start(wait=False)
    assert b.proc.wait(60) == 1
    out = b.output()
    assert "may be written by other users" in out and f"chmod +t {sock_dir}" in out and "Traceback" not in out
    assert stat.S_IMODE(os.stat(sock_dir).st_mode) == 0o777 and os.listdir(sock_dir) == []


def test_socket_in_a_sticky_shared_folder_serves_and_leaves_the_folder_as_it_is(model_files, make_broker, short_dir):
    """As `--address ipc:///tmp/x.sock`: /tmp (1777) is not tgw's, so its mode stays; the socket
    file is the broker's own (0660) and the workers' socket lives elsewhere."""
    sock_dir = os.path.join(short_dir, "shared")
    os.mkdir(sock_dir)
    os.chmod(sock_dir, 0o1777)
    b = make_broker(base_config(model_files, "mlp"), start=False)
    b.address = f"ipc://{sock_dir}/s.sock"
    b.start()
    with Client(b.address) as c:
        assert c.infer("mlp", {"x": np.ones((1, 256), np.float32)})["y"].shape == (1, 10)
    assert stat.S_IMODE(os.stat(ipc_path(b.address)).st_mode) == 0o660
    assert os.listdir(sock_dir) == ["s.sock"]   # no workers' socket beside it
    assert stat.S_IMODE(os.stat(sock_dir).st_mode) == 0o1777
    assert b.stop() == 0
    assert stat.S_IMODE(os.stat(sock_dir).st_mode) == 0o1777 and os.listdir(sock_dir) == []
    assert "is shared: left as it is" in b.output()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the directory to another user")
def test_socket_directory_of_another_user_that_others_may_write_is_refused(model_files, make_broker, short_dir):
    sock_dir = os.path.join(short_dir, "theirs")
    os.mkdir(sock_dir)
    os.chmod(sock_dir, 0o777)
    os.chown(sock_dir, 65534, 65534)
    b = make_broker(base_config(model_files, "mlp"), start=False)
    b.address = f"ipc://{sock_dir}/s.sock"
    b.start(wait=False)
    assert b.proc.wait(60) == 1
    out = b.output()
    assert "may be written by other users" in out and "Traceback" not in out
    assert os.listdir(sock_dir) == [] and list_segments(b.proc.pid) == []
