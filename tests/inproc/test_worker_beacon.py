"""The worker's beacon (workers/heartbeat.py) in-process: a ROUTER on inproc:// plays the broker's
control side; heartbeats, progress, leak snapshots, stop. Then the worker's preloads
(workers/main.py) and the custom ops of tests/worker_ext.py in fresh interpreters.

Every wait is bounded and on something observable (a socket poll, a flag); no test asserts a duration."""
from __future__ import annotations

import itertools
import os
import resource
import subprocess
import sys
import threading

import pytest
import torch
import zmq

import worker_ext
from conftest import wait_until
from tgw.shm.wire import Heartbeat, SnapshotRequest, WorkerSnapshot, encode, from_worker_decoder
from tgw.workers.heartbeat import CTL_SUFFIX, Beacon
from tgw.workers.progress import Progress
from tgw.workers.main import preload

WAIT_S = 10.0
IDENTITY = b"w3.0"
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # tests/: worker_ext.py
_endpoints = itertools.count()


class Control:
    """A Beacon on a Context shared with a ROUTER that reads what it sends."""

    def __init__(self, heartbeat_s: float):
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a request to nobody raises, never vanishes
        endpoint = f"inproc://tgw-beacon-{next(_endpoints)}"
        self.router.bind(endpoint)
        self.progress = Progress()
        self.beacon = Beacon(self.ctx, endpoint, IDENTITY, 3, self.progress, heartbeat_s=heartbeat_s)
        self.beacon.start()

    def recv(self, kind: type):
        """The next message of `kind`, skipping others; fails after WAIT_S without one."""
        while True:
            assert self.router.poll(int(WAIT_S * 1000)), f"no {kind.__name__} within {WAIT_S:.0f}s"
            ident, body = self.router.recv_multipart()
            assert ident == IDENTITY + CTL_SUFFIX
            msg = from_worker_decoder.decode(body)
            if isinstance(msg, kind):
                return msg

    def close(self) -> None:
        assert self.beacon.stop(timeout=WAIT_S)
        self.router.close(linger=0)
        self.ctx.term()


@pytest.fixture
def fast():
    c = Control(heartbeat_s=0.02)
    yield c
    c.close()


@pytest.fixture
def slow():
    """Beats only at start and then once a minute: anything else it sends answers a request."""
    c = Control(heartbeat_s=60.0)
    yield c
    c.close()


def test_heartbeats_describe_the_process(fast):
    beats = [fast.recv(Heartbeat) for _ in range(3)]
    for b in beats:
        assert (b.worker_id, b.pid, b.batches, b.batch_id) == (3, os.getpid(), 0, None)
        assert b.rss > 0 and b.fds > 0 and b.threads >= 2 and b.cpu_s > 0
        assert b.cuda_allocated == b.cuda_reserved == 0
        assert b.gpu is None and b.gpu_ooms == 0        # a CPU worker: no GPU figures, never an OOM
    assert beats[0].sent < beats[1].sent < beats[2].sent
    assert fast.beacon.gpu is None                     # and no NVML reader to ask


def test_heartbeats_carry_progress(fast):
    fast.progress.start(41)
    since = fast.progress.batch_since
    beat = fast.recv(Heartbeat)
    while beat.batch_id is None:  # sampled before start(): the next one has it
        beat = fast.recv(Heartbeat)
    assert (beat.batch_id, beat.batch_since, beat.batches) == (41, since, 0)
    fast.progress.end()
    beat = fast.recv(Heartbeat)
    while beat.batches == 0:
        beat = fast.recv(Heartbeat)
    assert (beat.batch_id, beat.batch_since, beat.batches) == (None, 0.0, 1)


def test_heartbeats_carry_the_oom_count(fast):
    fast.progress.gpu_ooms += 2     # as the serving loop counts them
    beat = fast.recv(Heartbeat)
    while beat.gpu_ooms == 0:       # sampled before the count: the next one has it
        beat = fast.recv(Heartbeat)
    assert beat.gpu_ooms == 2


class UntilFlag(torch.nn.Module):
    """Sets flag[1] on entry, then computes until flag[0] turns non-zero: a forward that
    provably runs while the test looks."""

    def forward(self, flag: torch.Tensor) -> torch.Tensor:
        flag[1] = 1.0
        m = torch.ones(32, 32)
        while bool(flag[0] == 0):
            m = m @ m / 32.0
        return m


def test_beats_continue_during_a_forward(fast):
    model, flag = torch.jit.script(UntilFlag()), torch.zeros(2)
    forward = threading.Thread(target=model, args=(flag,), daemon=True)  # the serving loop's part
    forward.start()
    try:
        wait_until(lambda: flag[1].item() == 1.0, WAIT_S, "the forward to start")
        fast.progress.start(5)  # beats that carry 5 were sampled after the forward began
        beat = fast.recv(Heartbeat)
        while beat.batch_id != 5:
            beat = fast.recv(Heartbeat)
        beats = [beat, fast.recv(Heartbeat), fast.recv(Heartbeat)]
        assert forward.is_alive()  # ... and before it ended: it cannot end until the flag is set
    finally:
        flag[0] = 1.0
        forward.join(WAIT_S)
    assert not forward.is_alive()
    assert [b.batch_id for b in beats] == [5, 5, 5]


def snapshot(c: Control, snapshot_id: int) -> WorkerSnapshot:
    c.router.send_multipart([IDENTITY + CTL_SUFFIX, encode(SnapshotRequest(snapshot_id=snapshot_id, top=50))])
    snap = c.recv(WorkerSnapshot)
    assert (snap.snapshot_id, snap.worker_id) == (snapshot_id, 3)
    return snap


def test_snapshots_name_the_line_that_grew(slow):
    slow.recv(Heartbeat)  # the first beat: from now on the router can address the beacon
    first = snapshot(slow, 1)  # answered at once, not at the next beat a minute away
    assert first.growth == [] and first.tracing_since > 0
    kept, line = [bytearray(4 << 20)], sys._getframe().f_lineno
    second = snapshot(slow, 2)
    assert second.tracing_since == first.tracing_since
    assert second.traced_bytes >= 4 << 20
    grown = {g.where: g for g in second.growth}
    assert all(g.size_diff > 0 for g in second.growth)
    assert grown[f"{__file__}:{line}"].size_diff >= 4 << 20
    del kept


def test_bad_control_messages_do_not_stop_the_beacon(slow):
    slow.recv(Heartbeat)
    slow.router.send_multipart([IDENTITY + CTL_SUFFIX, b"\xc1not msgpack"])
    slow.router.send_multipart([IDENTITY + CTL_SUFFIX, encode(Heartbeat(worker_id=0, pid=0, sent=0, rss=0, cpu_s=0,
                                                                        fds=0, threads=0, batches=0))])
    assert snapshot(slow, 7).growth == []


def test_stop_ends_the_thread_and_closes_its_socket(slow):
    slow.recv(Heartbeat)
    assert slow.beacon.stop(timeout=WAIT_S)  # prompt, though the next beat is a minute away
    assert not slow.beacon.thread.is_alive() and slow.beacon.sock.closed
    assert slow.beacon.stop()  # again: nothing left to do
    ctx = zmq.Context()
    never = Beacon(ctx, "inproc://tgw-beacon-never", IDENTITY, 3, Progress())
    assert never.stop() and never.sock.closed  # a beacon never started closes too
    ctx.term()


# ---- preloads and the test ops ----------------------------------------------------------------

def test_preload_imports_modules_and_files_and_names_failures():
    preload("")
    preload(" worker_ext , " + os.path.join(HERE, "worker_ext.py"))  # once registered, the same module
    assert torch.ops.tgw_test.leak(torch.ones(2, 1), 10).tolist() == [[1.0], [1.0]]
    with pytest.raises(RuntimeError, match=r"preload 'tgw_no_such_module' failed: ModuleNotFoundError"):
        preload("worker_ext,tgw_no_such_module")
    with pytest.raises(RuntimeError, match=r"preload '/nonexistent/libops.so' failed"):
        preload("/nonexistent/libops.so")


FRESH = """
import sys, torch
from tgw.workers.main import preload
if sys.argv[2]:
    preload(sys.argv[2])
m = torch.jit.freeze(torch.jit.load(sys.argv[1]).eval())
with torch.inference_mode():
    print(m(torch.tensor([[1.0], [2.0]])).tolist(), flush=True)
    if sys.argv[2]:
        import worker_ext
        print(len(worker_ext.LEAKED), flush=True)
        m(torch.tensor([[1.0], [worker_ext.POISON]]))
print("survived poison")
"""


def fresh(model: str, preloads: str, cwd) -> subprocess.CompletedProcess:
    """Load and run `model` in a new interpreter (no core file when it aborts)."""
    env = {**os.environ, "PYTHONPATH": HERE}
    return subprocess.run([sys.executable, "-c", FRESH, model, preloads], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env=env,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0)))


@pytest.mark.parametrize("name", ["crash_on", "leaky"])
def test_scripted_models_need_the_preload(name, tmp_path):
    path = str(tmp_path / f"{name}.pt")
    worker_ext.save(name, path)
    r = fresh(path, "", tmp_path)
    assert r.returncode == 1 and f"tgw_test::{'crash_if' if name == 'crash_on' else 'leak'}" in r.stderr
    r = fresh(path, "worker_ext", tmp_path)
    lines = r.stdout.splitlines()
    assert lines[0] == "[[1.0], [2.0]]", r.stderr
    if name == "crash_on":
        assert r.returncode == -6 and "survived" not in r.stdout  # SIGABRT on the poison row
    else:
        assert r.returncode == 0 and lines[1] == "1" and lines[2] == "survived poison"
