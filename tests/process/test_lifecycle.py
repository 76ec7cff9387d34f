"""Start, stop, crash and restart: nothing lost, nothing left in /dev/shm."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import psutil
import pytest

from conftest import base_config, in_flight, kill_broker, wait_until
from tgw.broker.fleet.exits import ExitWatch
from tgw.client import Client, TgwError
from tgw.shm.errors import Code
from tgw.shm.paths import ipc_path
from tgw.shm.segment import list_segments

X = np.zeros((1, 256), np.float32)


def spin(rounds: int) -> dict:
    return {"x": np.full((1, 1), rounds, np.float32)}


def test_clean_stop_leaves_nothing(model_files, make_broker):
    b = make_broker(base_config(model_files, "mlp"))
    pid, workers = b.proc.pid, b.worker_pids()
    assert len(list_segments(pid)) == 1
    assert b.stop() == 0
    assert list_segments(pid) == []
    assert not os.path.exists(ipc_path(b.address))
    assert not any(psutil.pid_exists(w) and psutil.Process(w).status() != psutil.STATUS_ZOMBIE for w in workers)


def test_process_titles_name_broker_and_workers(model_files, make_broker):
    b = make_broker(base_config(model_files, "mlp"))
    titles = [" ".join(psutil.Process(pid).cmdline()).strip() for pid in [b.proc.pid, *b.worker_pids()]]
    assert titles == ["tgw-broker", "tgw-worker 0 cpu"]


def test_sigkill_of_broker_then_restart_sweeps(model_files, make_broker):
    b = make_broker(base_config(model_files, "mlp"))
    pid = b.proc.pid
    stale = list_segments(pid)
    kill_broker(b)
    assert list_segments(pid) == stale and stale  # left behind by the crash...
    b2 = make_broker(base_config(model_files, "mlp"), sub="again")
    assert list_segments(pid) == []                # ...and swept by the next start
    assert "swept" in b2.output()
    with Client(b2.address) as c:
        assert c.infer("mlp", {"x": X})["y"].shape == (1, 10)


def test_stale_socket_file_is_replaced(model_files, make_broker):
    b = make_broker(base_config(model_files, "mlp"))
    kill_broker(b)
    b.start()  # same address: the dead broker's socket file must not block it
    with Client(b.address) as c:
        assert c.infer("mlp", {"x": X})["y"].shape == (1, 10)


def test_second_broker_on_same_address_is_refused(model_files, make_broker):
    b = make_broker(base_config(model_files, "mlp"))
    b2 = make_broker(base_config(model_files, "mlp"), start=False)
    b2.address = b.address
    b2.start(wait=False)
    assert b2.proc.wait(60) != 0
    assert "already listening" in b2.output()


def test_worker_failing_to_load_fails_startup(model_files, make_broker):
    b = make_broker(base_config(model_files, "mlp", "wrongdtype"), start=False)
    b.start(wait=False)
    assert b.proc.wait(60) != 0
    out = b.output()
    assert "wrongdtype" in out and "float64" in out, out
    assert list_segments(b.proc.pid) == []


def test_worker_dying_while_starting_fails_startup_naming_it_and_its_exit_code(model_files, make_broker, tmp_path):
    """The start waits on the workers' exits as on their hellos: the death is named at once,
    not after workers.start_timeout_s."""
    dies = tmp_path / "tgw_dies_at_import.py"
    dies.write_text("import os\nos._exit(3)\n")
    cfg = base_config(model_files, "mlp", workers={"devices": ["cpu"], "input_arena_mb": 8, "output_arena_mb": 4,
                                                   "start_timeout_s": 600, "preload": [str(dies)]})
    b = make_broker(cfg, start=False)
    b.start(wait=False)
    assert b.proc.wait(120) == 1
    out = b.output()
    assert "start-up failed: worker0[cpu] (pid " in out, out
    assert "exited with code 3 during start-up (its error is printed above)" in out, out
    assert "not ready after" not in out and list_segments(b.proc.pid) == []


def test_worker_killed_is_restarted_and_work_is_not_lost(model_files, make_broker):
    b = make_broker(base_config(model_files, "mlp", "spin"))
    results: list = []
    with Client(b.address) as c:
        t = _long_spin_in_flight(c, results)
        old = b.worker_pids()[0]
        os.kill(old, signal.SIGKILL)
        t.join(60)
        # retried once on the restarted worker, or answered WORKER_DIED - never silence
        assert results and (isinstance(results[0], dict) or results[0].code == Code.WORKER_DIED), results
        wait_until(lambda: c.health()["ready"], 60, "the restarted worker to be ready")
        assert c.infer("mlp", {"x": X})["y"].shape == (1, 10)
    assert b.worker_pids() and b.worker_pids()[0] != old


def _long_spin_in_flight(c: Client, results: list, rounds: int = 1500) -> threading.Thread:
    """Start a spin request (1500 rounds: ~0.7 s) in a thread; return once a worker holds it."""
    t = threading.Thread(target=lambda: results.append(_try(c, "spin", spin(rounds))))
    t.start()
    wait_until(lambda: in_flight(c) == 1, 30, "the spin request to reach a worker")
    return t


def _try(c: Client, model: str, inputs: dict):
    try:
        return c.infer(model, inputs)
    except TgwError as err:
        return err


def test_deadline_exceeded_before_compute(model_files, make_broker):
    # one batch in flight per worker: the short request queues in the broker behind the long one
    b = make_broker(base_config(model_files, "spin", server={"max_inflight_batches_per_worker": 1},
                                spin={"max_batch_size": 1}))
    results: list = []
    with Client(b.address) as c:
        t = _long_spin_in_flight(c, results)
        with pytest.raises(TgwError) as info:
            c.infer("spin", spin(1), timeout=0.1)
        assert info.value.code == Code.DEADLINE_EXCEEDED
        t.join(60)
        assert results and isinstance(results[0], dict), results
        stats = wait_until(lambda: (s := c.stats()["models"]["spin"])["errors"] and s, 30,
                           "the broker to count the expired request")
    assert stats["errors"] == {"DEADLINE_EXCEEDED": 1}
    assert stats["rows"] == 1 and stats["replies"] == 1  # the long spin only: the late one never ran


def test_queue_full_is_overloaded(model_files, make_broker):
    b = make_broker(base_config(model_files, "spin", spin={"max_batch_size": 1, "max_queue": 2}))
    codes: list = []
    with Client(b.address) as c:
        threads = [threading.Thread(target=lambda: codes.append(_try(c, "spin", spin(600)))) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    errors = [r.code for r in codes if isinstance(r, TgwError)]
    assert len(codes) == 8 and Code.OVERLOADED in errors
    assert set(errors) == {Code.OVERLOADED}


def test_sigterm_finishes_in_flight_work(model_files, make_broker):
    b = make_broker(base_config(model_files, "spin"))
    results: list = []
    with Client(b.address) as c:
        t = _long_spin_in_flight(c, results)  # SIGTERM only once the broker holds the request
        b.proc.send_signal(signal.SIGTERM)
        t.join(60)
    assert b.proc.wait(30) == 0
    assert results and isinstance(results[0], dict), results
    assert list_segments(b.proc.pid) == []


def test_pin_cpus_gives_each_worker_its_own_core(model_files, make_broker):
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    b = make_broker(base_config(model_files, "mlp", workers={"devices": ["cpu", "cpu"], "pin_cpus": True,
                                                             "input_arena_mb": 4, "output_arena_mb": 2}))
    with Client(b.address) as c:
        pids = [p["pid"] for p in c.stats()["processes"] if p["role"] == "worker"]
    affinities = [psutil.Process(pid).cpu_affinity() for pid in pids]
    assert affinities == [[cores[0]], [cores[1]]]


def test_systemd_notify_ready_watchdog_stopping(model_files, make_broker, short_dir):
    import socket
    path = os.path.join(short_dir, "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(30)
    try:
        b = make_broker(base_config(model_files, "mlp"), start=False)
        b.start(env={"NOTIFY_SOCKET": path})
        seen = [sock.recv(4096).decode()]
        while not any("WATCHDOG=1" in m for m in seen):
            seen.append(sock.recv(4096).decode())
        assert seen[0].startswith("READY=1") and "STATUS=serving on" in seen[0]
        assert b.stop() == 0
        while "STOPPING=1" not in seen[-1]:
            seen.append(sock.recv(4096).decode())
    finally:
        sock.close()


def test_health_follows_the_workers(model_files, make_broker):
    """With its only worker dead, the broker is live but not ready; ready again after the restart."""
    b = make_broker(base_config(model_files, "mlp"))
    with Client(b.address) as c:
        os.kill(b.worker_pids()[0], signal.SIGKILL)
        h = wait_until(lambda: (h := c.health())["ready"] is False and h, 30, "the broker to notice the death")
        assert h["live"] and not h["ready"] and h["models"] == {"mlp": False}
        # admitted meanwhile: it waits for the restarted worker instead of failing
        assert c.infer("mlp", {"x": X}, timeout=30)["y"].shape == (1, 10)
        assert c.health()["ready"]


def test_tcp_address_without_curve_keys_is_refused(model_files, make_broker):
    """tcp:// only with CURVE (tests/process/test_security.py serves it); --address cannot get around it."""
    b = make_broker(base_config(model_files, "mlp"), start=False)
    b.address = "tcp://127.0.0.1:9"
    b.start(wait=False)
    assert b.proc.wait(60) == 1
    out = b.output()
    assert "curve_secret_key_file" in out and "Traceback" not in out
    assert list_segments(b.proc.pid) == []


def test_timeout_is_kept_while_computing_and_the_late_answer_is_withdrawn(model_files, make_broker):
    b = make_broker(base_config(model_files, "spin", "mlp"))
    with Client(b.address) as c, Client(b.address) as observer:
        c.infer("spin", spin(1))
        with pytest.raises(TgwError) as info:
            c.infer("spin", spin(4000), timeout=0.2)  # ~2 s of compute
        # the client gave up on its own, while the worker still computes (not held until the end),
        # and withdrew the request: its answer is dropped and counted, never sent
        assert info.value.code == Code.DEADLINE_EXCEEDED and "no reply" in info.value.message
        wait_until(lambda: observer.stats()["cancelled"].get("spin", {}).get("computing") == 1, 60,
                   "the computing request to be counted as withdrawn")
        assert observer.stats()["models"]["spin"]["replies"] == 1
        # the cancel's own reply waits on this thread's socket now, and is not taken for this request
        assert c.infer("mlp", {"x": X})["y"].shape == (1, 10)



@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="no pidfds here: the monitor's look sees exits")
def test_exit_watch_wakes_the_loop_when_a_process_exits():
    """What the start-up waits on besides the hellos: a pidfd per worker on the loop's selector."""
    async def main():
        exited = asyncio.Event()
        watch = ExitWatch(asyncio.get_running_loop(), exited.set)
        proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(4)"])
        watch.add(proc)
        assert not watch.polling
        await asyncio.wait_for(exited.wait(), 60)
        watch.close()
        return proc.wait(5)

    assert asyncio.run(main()) == 4
