"""The GPU path's parts that run without a GPU: which devices the workers get (CUDA_VISIBLE_DEVICES
read as CUDA reads it), the ring's page-locking modes in the config, and an out-of-memory in a
real broker (the test op of tests/worker_ext.py raises what CUDA's allocator raises)."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import EXT, base_config, wait_until
from tgw.broker.config.load import ConfigError, parse_config
from tgw.broker.config.startup import StartupError
from tgw.broker.fleet.gpus import mig_instances, plan_devices, visible_count
from tgw.broker.fleet.supervisor import Supervisor
from tgw.broker.config.schema import WorkersDecl
from tgw.broker.config.load import SupervisorDecl
from tgw.broker.state.pool import WorkerHandle
from tgw.shm.segment import Segment, new_name
from tgw.client import Client, OutOfGpuMemoryError

UUIDS = ["GPU-1111aaaa-0000-0000-0000-000000000000", "GPU-2222bbbb-0000-0000-0000-000000000000",
         "GPU-3333cccc-0000-0000-0000-000000000000"]


@pytest.mark.parametrize("env, visible", [
    (None, 3),                      # unset: every GPU
    ("", 0),                        # empty: none
    ("0,2", 2), ("2", 1),
    ("0,7,1", 1),                   # stops at the first invalid index
    ("1,1", 1),                     # a repeat is invalid too
    ("-1", 0),
    ("GPU-2222bbbb", 1),            # a unique UUID prefix
    ("2222bbbb-0000-0000-0000-000000000000,0", 2),   # "GPU-" may be left out
    ("GPU-", 0),                    # matches every GPU: ambiguous
    ("GPU-9999", 0),
    (" 1 , 0 ", 2),
    ("MIG-5e7c4d2a-aaaa-bbbb-cccc-000000000000", 1),
])
def test_visible_gpus_follow_cuda_visible_devices(env, visible):
    assert visible_count(UUIDS, env) == visible


def test_auto_devices_one_worker_per_visible_gpu():
    auto = WorkersDecl(devices="auto")
    assert plan_devices(auto, UUIDS, None) == ["cuda:0", "cuda:1", "cuda:2"]
    assert plan_devices(auto, UUIDS, "2,0") == ["cuda:0", "cuda:1"]   # torch's indices in the worker
    assert plan_devices(auto, UUIDS, "") == ["cpu"]
    assert plan_devices(auto, [], None) == ["cpu"]


def test_an_explicit_gpu_that_is_not_visible_stops_the_start_naming_why():
    listed = WorkersDecl(devices=["cpu", "cuda:0", "cuda:1"])
    assert plan_devices(listed, UUIDS, "0,1") == ["cpu", "cuda:0", "cuda:1"]
    with pytest.raises(StartupError) as err:
        plan_devices(listed, UUIDS, "2")
    assert str(err.value) == ("workers.devices.2: cuda:1 is not a GPU this broker can use: 1 visible "
                              "(CUDA_VISIBLE_DEVICES='2'); cuda:N counts the visible GPUs from 0")
    with pytest.raises(StartupError, match=r"^workers.devices.1: cuda:0 is not a GPU this broker can use: 0 visible;"):
        plan_devices(listed, [], None)


def test_cuda_host_memory_is_one_of_three(model_files, tmp_path):
    cfg = {"model_roots": ["/"], **base_config(model_files, "mlp")}
    for mode in ("register", "staging", "pageable"):
        cfg["workers"]["cuda_host_memory"] = mode
        assert parse_config(cfg, str(tmp_path)).workers.cuda_host_memory == mode
    cfg["workers"]["cuda_host_memory"] = "pinned"
    with pytest.raises(ConfigError, match="workers.cuda_host_memory"):
        parse_config(cfg, str(tmp_path))


def test_out_of_gpu_memory_answers_that_request_and_the_worker_serves_on(model_files, ext_models, make_broker):
    """A request too large for the device alone is answered OUT_OF_GPU_MEMORY after one retry on
    an emptied cache; the breaker counts it as a failure; the same worker (same pid) serves the
    next request; the heartbeats count every out-of-memory event."""
    files = {**model_files, **ext_models}
    b = make_broker(base_config(files, "gpu_hungry", workers={"devices": ["cpu"], "preload": [EXT],
                                                              "input_arena_mb": 2, "output_arena_mb": 2},
                                gpu_hungry={"breaker": {"min_requests": 100}}))
    with Client(b.address) as c:
        pid = [p["pid"] for p in c.stats()["processes"] if p["role"] == "worker"]
        with pytest.raises(OutOfGpuMemoryError) as err:
            c.infer("gpu_hungry", {"x": np.ones((6, 1), np.float32)})
        assert err.value.message.startswith("CUDA out of memory. Tried to allocate 6 rows")
        y = c.infer("gpu_hungry", {"x": np.full((3, 1), 2.0, np.float32)})["y"]
        np.testing.assert_array_equal(y, np.full((3, 1), 4.0, np.float32))
        stats = c.stats()
        assert [p["pid"] for p in stats["processes"] if p["role"] == "worker"] == pid
        breaker = stats["models"]["gpu_hungry"]["breakers"]["1"]
        assert (breaker["window_requests"], breaker["window_failed"]) == (2, 1)
        worker = wait_until(lambda: next((w for w in c.status()["workers"] if w.get("gpu_ooms")), None),
                            30, "a heartbeat counting the out-of-memory events")
        assert worker["gpu_ooms"] == 2 and worker.get("gpu") is None   # tried, then tried alone; a CPU worker


def test_the_memory_trip_reads_a_gpu_workers_heartbeat():
    """NVML's device figures from the heartbeat; without them the worker's reserved CUDA memory
    against the device size its hello gave; on the CPU, RSS against the host."""
    from tgw.broker.sched.pressure import host_memory, memory_fraction
    from tgw.shm.wire import GpuReading, Heartbeat
    beat = Heartbeat(worker_id=0, pid=1, sent=0.0, rss=1 << 30, cpu_s=0.0, fds=1, threads=1, batches=0,
                     cuda_reserved=10 << 30, gpu=GpuReading(memory_used=60 << 30, memory_total=80 << 30))
    assert memory_fraction("cuda:0", beat, 40 << 30) == 0.75
    beat.gpu = GpuReading(memory_used=None, memory_total=None)       # NVML without memory figures
    assert memory_fraction("cuda:0", beat, 40 << 30) == 0.25
    beat.gpu = None
    assert memory_fraction("cuda:0", beat, 40 << 30) == 0.25
    assert memory_fraction("cuda:0", beat) == memory_fraction("cpu", beat) == (1 << 30) / host_memory()


MIGS = ["MIG-5e7c4d2a-aaaa-bbbb-cccc-000000000000", "MIG-5e7c4d2a-aaaa-bbbb-cccc-000000000001"]


def test_each_mig_instance_is_a_worker_that_sees_it_alone(tmp_path):
    env = ",".join(MIGS)
    devices = plan_devices(WorkersDecl(devices="auto"), UUIDS, env)
    assert devices == ["cuda:0", "cuda:1"]
    assert mig_instances(devices, env, UUIDS) == {"cuda:0": MIGS[0], "cuda:1": MIGS[1]}
    assert mig_instances(devices, "0,1", UUIDS) == {} and mig_instances(devices, None, UUIDS) == {}
    sup = Supervisor(WorkersDecl(devices=["cpu"], input_arena_mb=1, output_arena_mb=1),
                     SupervisorDecl(snapshot_dir=str(tmp_path)), "ipc:///nowhere")
    sup.mig = mig_instances(devices, env, UUIDS)
    seg = Segment.create(new_name("ring"), 4096)
    try:
        second = WorkerHandle(1, "cuda:1", [], seg, 2048, 2048)
        start = sup.start_for(second)
        assert start.device == "cuda:0"            # its one visible device ...
        assert sup.spawn_env(second)["CUDA_VISIBLE_DEVICES"] == MIGS[1]   # ... is its instance
        assert sup.spawn_env(WorkerHandle(0, "cpu", [], seg, 2048, 2048)) is None
    finally:
        seg.close()
        seg.unlink()
