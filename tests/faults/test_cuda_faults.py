"""Sticky CUDA errors on the CPU: a model whose custom op raises what torch raises after an
illegal memory access, for one poison input (tests/worker_ext.py FaultOn). The worker that meets
it is poisoned, not the request: it answers nothing, is replaced, and what it held is retried
alone; the poison is blamed after at most two faults. Repeated faults take the device out of
service, and health says which capacity is missing. (tests/gpu/test_cuda_faults_gpu.py: the
same with a real device-side assert.)"""
from __future__ import annotations

import glob
import json
import os
import time
import urllib.error
import urllib.request

import numpy as np

from conftest import EXT, Load, base_config, wait_until
from tally import Tally, row
from tgw.client import Client
from tgw.shm.errors import Code, TgwError

POISON = 13.0
TWO_WORKERS = {"devices": ["cpu", "cpu"], "threads_per_worker": 1, "input_arena_mb": 4, "output_arena_mb": 2,
               "preload": [EXT]}


def fault_config(files: dict, snapshot_dir: str, workers: dict, **supervisor) -> dict:
    return {**base_config(files, "fault_on", workers=workers, fault_on={"max_batch_size": 8},
                          supervisor={"snapshot_dir": snapshot_dir, **supervisor}), "http": {"port": 0}}


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_a_sticky_cuda_error_poisons_the_worker_not_its_batch_mates(model_files, ext_models, make_broker, short_dir):
    snaps = os.path.join(short_dir, "snaps")
    b = make_broker(fault_config({**model_files, **ext_models}, snaps, TWO_WORKERS))
    wrong: list = []

    def check(inputs, outcome) -> None:   # every answer is 2x its own input, or it is wrong
        if isinstance(outcome, dict) and not np.array_equal(outcome["y"], inputs["x"] * 2):
            wrong.append((inputs["x"], outcome["y"]))

    mates, poison = Tally("sticky CUDA error: the other requests, 16 callers"), Tally("sticky CUDA error: the poison")
    load = Load(b.address, 16, lambda i, k: {"x": np.full((1, 1), 100 + i * 10**5 + k, np.float32)},
                model="fault_on", tally=mates, on_result=check)
    with Client(b.address) as c:
        pids = {w["pid"] for w in c.status()["workers"]}
        wait_until(lambda: len(load.results) > 100, 60, "traffic to flow")
        t0 = time.monotonic()
        err = poison.call(c.infer, "fault_on", {"x": np.full((1, 1), POISON, np.float32)})
        blamed_s = time.monotonic() - t0
        wait_until(lambda: all(w["state"] == "ready" for w in c.status()["workers"]), 60, "the replaced workers to serve")
        recovered_s = time.monotonic() - t0
        served_before = len(load.results)
        wait_until(lambda: len(load.results) > served_before + 100, 60, "traffic to flow after the faults")
        status = c.status()
        metrics = get(f"{status['http']}/metrics")[1]
    load.finish()
    faults = status["cuda_faults"]
    row(mates, f"{len(wrong)} wrong answers")
    row(poison, f"blamed after {faults['total']} fault(s) in {blamed_s:.2f} s; every worker serving again "
                f"{recovered_s:.2f} s after it was sent; {getattr(err, 'message', err)[:90]!r}")
    assert isinstance(err, TgwError) and err.code is Code.WORKER_DIED
    assert err.details["poison"] is True and err.details["cuda_fault"] is True
    assert mates.counts == {"ok": mates.sent} and wrong == []
    assert 1 <= faults["total"] <= 2 and faults["by_device"] == {"cpu": faults["total"]}
    last = faults["recent"][-1]
    assert "model=fault_on" in last["blamed"] and "illegal memory access" in last["error"]
    assert last["kind"] == "an illegal memory access was encountered" and last["device"] == "cpu"
    assert {w["pid"] for w in status["workers"]} != pids   # a new process (a new CUDA context)
    assert sum(w["restarts"] for w in status["workers"]) == faults["total"]
    assert status["devices"]["cpu"]["state"] == "serving"
    assert f'tgw_worker_cuda_faults_total{{device="cpu",uuid=""}} {float(faults["total"])}' in metrics
    assert 'tgw_device_state{device="cpu",state="serving",uuid=""} 1.0' in metrics
    snapshot, = [json.load(open(p)) for p in glob.glob(os.path.join(snaps, "*-fault.json"))
                 if json.load(open(p))["fault"]["blamed"]]
    assert snapshot["fault"]["blamed"] == last["blamed"] and snapshot["device"] == "cpu"
    assert '"event": "cuda_fault"' in b.output() or "sticky CUDA error" in b.output()


def test_repeated_faults_take_the_device_out_of_service(model_files, ext_models, make_broker, short_dir):
    one = {"devices": ["cpu"], "threads_per_worker": 1, "input_arena_mb": 4, "output_arena_mb": 2, "preload": [EXT]}
    cfg = fault_config({**model_files, **ext_models}, os.path.join(short_dir, "snaps"), one,
                       cuda_faults={"faults": 2, "window_s": 60.0, "out_of_service_s": 300.0})
    b = make_broker(cfg)
    t = Tally("sticky CUDA error x2 on one device (faults: 2)")
    with Client(b.address) as c:
        http = c.status()["http"]
        assert t.call(c.infer, "fault_on", {"x": np.ones((1, 1), np.float32)})["y"][0, 0] == 2.0
        err = t.call(c.infer, "fault_on", {"x": np.full((1, 1), POISON, np.float32)})
        status = wait_until(lambda: (s := c.status())["devices"]["cpu"]["state"] == "out_of_service" and s, 30,
                            "the device to be out of service")
        after = t.call(c.infer, "fault_on", {"x": np.ones((1, 1), np.float32)}, timeout=10)
        health = c.health()
    metrics = get(f"{http}/metrics")[1]
    code, text = get(f"{http}/v2/health/ready")
    ready = json.loads(text)
    row(t, f"device: {status['devices']['cpu']['reason'][:60]}")
    assert err.code is Code.WORKER_DIED and err.details["poison"] is True
    assert status["cuda_faults"]["total"] == 2 and "cpu" in status["cuda_faults"]["out_of_service"]
    assert status["devices"]["cpu"]["models_lost"] == ["fault_on"]
    assert isinstance(after, TgwError) and after.code is Code.MODEL_NOT_READY and "out of service" in after.message
    assert not health["ready"] and health["devices"]["cpu"]["state"] == "out_of_service"
    assert code == 400 and not ready["ready"] and ready["devices"]["cpu"]["state"] == "out_of_service"
    assert ready["missing"] and ready["missing"][0].startswith("cpu is out_of_service") and "fault_on" in ready["missing"][0]
    assert 'tgw_device_state{device="cpu",state="out_of_service",uuid=""} 1.0' in metrics
    assert "out of service" in b.output()
