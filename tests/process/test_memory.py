"""Memory snapshots and leak recycling with real processes: a model that leaks 1 MiB per call
is noticed from its heartbeats, snapshotted (tracemalloc growth naming the leaking line) and
replaced by a fresh worker without a failed request; operators take snapshots on demand with
`tgw-broker snapshot` and SIGUSR1."""
from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys

import numpy as np

from conftest import EXT, Load, base_config, wait_until
from tgw.client import Client

LEAK = {"heartbeat_s": 0.2, "hang_timeout_s": 5.0,
        "leak": {"window_s": 30.0, "min_samples": 5, "mib_per_1k_batches": 200.0, "trace_s": 1.0}}


def snapshots(d: str) -> list[str]:
    return sorted(glob.glob(os.path.join(d, "*.json")))


def test_leaking_worker_is_snapshotted_and_recycled_without_failures(model_files, ext_models, make_broker,
                                                                     short_dir):
    snap_dir = os.path.join(short_dir, "snaps")
    files = {**model_files, **ext_models}
    b = make_broker(base_config(files, "leaky", workers={"devices": ["cpu"], "preload": [EXT], "input_arena_mb": 2,
                                                        "output_arena_mb": 2},
                                supervisor={**LEAK, "snapshot_dir": snap_dir}, leaky={"max_batch_size": 4}))
    load = Load(b.address, 4, lambda i, k: {"x": np.ones((1, 1), np.float32)}, model="leaky")
    with Client(b.address) as c:
        path = wait_until(lambda: snapshots(snap_dir), 120, "a leak snapshot")[0]
        # the leaking worker retires once its successor serves (which, leaking too, may follow it)
        workers = wait_until(lambda: (ws := c.status()["workers"]) and "worker0[cpu]" not in [w["name"] for w in ws]
                             and ws, 120, "worker0 to retire")
    outcomes = load.finish()
    with open(path) as f:
        snap = json.load(f)
    rss = [s["rss"] >> 20 for s in snap["rss_history"]]
    print(f"\nleak: {snap['reason']}\n  RSS MiB over the window: {rss}\n  batches: "
          f"{[s['batches'] for s in snap['rss_history']]}\n  outcomes {dict(outcomes)}; now {workers}")
    assert set(outcomes) == {"ok"}                             # zero failed requests
    assert snap["reason"].startswith("leak: RSS rising") and snap["worker"] == "worker0[cpu]"
    assert any("worker_ext.py" in g["where"] for g in snap["tracemalloc"]["growth"])
    assert len(rss) >= 5 and rss[-1] > rss[0]
    assert snap["ring"]["input_capacity"] == 2 << 20 and snap["dev_shm"]
    assert workers[0]["name"] == "worker1[cpu]" and workers[0]["restarts"] == 0  # retired, not restarted
    assert "retired" in b.output()


def test_snapshot_on_demand_and_on_sigusr1(model_files, make_broker, short_dir):
    snap_dir = os.path.join(short_dir, "snaps")
    b = make_broker(base_config(model_files, "mlp", supervisor={"snapshot_dir": snap_dir}))
    cmd = [sys.executable, "-m", "tgw.broker", "snapshot", "--address", b.address]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    path, = out.stdout.split()
    with open(path) as f:
        snap = json.load(f)
    assert snap["reason"] == "requested" and snap["heartbeat"]["pid"] == b.worker_pids()[0]
    assert snap["tracemalloc"]["growth"] == []                 # tracing starts with the first snapshot
    b.proc.send_signal(signal.SIGUSR1)
    wait_until(lambda: len(snapshots(snap_dir)) == 2, 60, "the SIGUSR1 snapshot")
    with Client(b.address) as c:                               # status lists the recent files
        assert wait_until(lambda: c.status()["snapshots"] == snapshots(snap_dir), 30, "status to list both")
    bad = subprocess.run(cmd + ["--worker", "7"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "no live worker 7" in bad.stderr
