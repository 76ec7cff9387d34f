"""GPU figures in heartbeats: the worker's NVML reader (workers/gpu_readings.py) on this box and
against a stand-in pynvml module, and the broker's rendering of heartbeats that carry them
(broker/observe/metrics.py gpu_families, status.gpu_status, the `status` printout). The CPU broker's scrape and
status without them: tests/process/test_metrics.py; the wire: tests/unit/test_wire.py."""
from __future__ import annotations

import logging
import sys
from types import SimpleNamespace

import pytest

from tgw.broker.cli import main as cli
from tgw.broker.observe.metrics import READINGS, gpu_families
from tgw.broker.observe.status import gpu_status
from tgw.shm.wire import PROTOCOL_VERSION, Heartbeat, StatusReply
from tgw.shm.wire_worker import GpuReading
from tgw.workers import gpu_readings
from tgw.workers.gpu_readings import SLOW_EVERY, GpuReader, nvml_uuids

UUID = "6f1e3b2a-0c4d-4e5f-8a9b-0123456789ab"
NAMES = [name for name, _, _ in READINGS]


# ---- the worker's reader ---------------------------------------------------------------------

def test_uuid_spellings_nvml_takes():
    assert nvml_uuids(f"GPU-{UUID}") == nvml_uuids(f"gpu-{UUID}") == [f"GPU-{UUID}"]
    assert nvml_uuids(f"MIG-{UUID}") == [f"MIG-{UUID}"]
    assert nvml_uuids(f" {UUID}\n") == [f"GPU-{UUID}", f"MIG-{UUID}"]   # torch's bare spelling
    assert nvml_uuids("") == []


def test_no_nvml_here_means_none_and_one_attempt(monkeypatch, caplog):
    """This box has no NVML driver: the real pynvml fails to start, once, quietly."""
    import pynvml
    inits = []

    def counted_init(*args, **kwargs):
        inits.append(1)
        return real_init(*args, **kwargs)
    real_init = pynvml.nvmlInit
    monkeypatch.setattr(pynvml, "nvmlInit", counted_init)
    reader = GpuReader(f"GPU-{UUID}")   # on a box with NVML: a device it does not know, the same answer
    with caplog.at_level(logging.INFO, logger="tgw.worker"):
        assert reader.read() is None and reader.read() is None and reader.read() is None
    assert inits == [1] and reader.failed
    assert len([r for r in caplog.records if "heartbeats carry no GPU figures" in r.getMessage()]) == 1


class FakeNvml(SimpleNamespace):
    """pynvml's calls the reader makes, for one device (UUID) whose power NVML does not report."""
    NVML_TEMPERATURE_GPU = 0
    NVML_ERROR_NOT_SUPPORTED = 3

    class NVMLError(Exception):
        def __init__(self, value: int):
            super().__init__(f"NVML error {value}")
            self.value = value

    def __init__(self, fail: bool = False, uuid: str = f"GPU-{UUID}"):
        super().__init__(fail=fail, uuid=uuid, calls=[], used=3 << 30, temperature=61)

    def nvmlInit(self):
        self.calls.append("init")
        if self.fail:
            raise self.NVMLError(12)        # NVML_ERROR_LIBRARY_NOT_FOUND

    def nvmlShutdown(self):
        self.calls.append("shutdown")

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self.calls.append(("handle", uuid))
        if uuid != self.uuid:
            raise self.NVMLError(6)         # NVML_ERROR_NOT_FOUND
        return "h"

    def nvmlDeviceGetMemoryInfo(self, h):
        self.calls.append("memory")
        return SimpleNamespace(used=self.used, total=80 << 30, free=(80 << 30) - self.used)

    def nvmlDeviceGetUtilizationRates(self, h):
        self.calls.append("utilization")
        return SimpleNamespace(gpu=42, memory=10)

    def nvmlDeviceGetTemperature(self, h, sensor):
        self.calls.append("temperature")
        assert sensor == self.NVML_TEMPERATURE_GPU
        return self.temperature

    def nvmlDeviceGetPowerUsage(self, h):
        self.calls.append("power")
        raise self.NVMLError(self.NVML_ERROR_NOT_SUPPORTED)


@pytest.fixture
def fake(monkeypatch):
    nv = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    return nv


def test_readings_by_uuid_in_nvml_units(fake):
    reader = GpuReader(UUID)              # bare, as some torch versions print it
    assert reader.read() == GpuReading(memory_used=3 << 30, memory_total=80 << 30, utilization=0.42,
                                       temperature_c=61.0, power_w=None)
    assert fake.calls[:2] == ["init", ("handle", f"GPU-{UUID}")]


def test_an_unsupported_figure_is_not_asked_again_and_slow_ones_are_read_every_few_beats(fake):
    reader = GpuReader(f"GPU-{UUID}")
    first = reader.read()
    fake.used, fake.temperature = 5 << 30, 70
    later = [reader.read() for _ in range(SLOW_EVERY)]
    assert fake.calls.count("init") == 1 and fake.calls.count("power") == 1
    assert fake.calls.count("memory") == fake.calls.count("utilization") == SLOW_EVERY + 1
    assert fake.calls.count("temperature") == 2          # the first beat and the SLOW_EVERY-th after it
    assert first.temperature_c == 61.0 and [r.temperature_c for r in later] == [61.0] * (SLOW_EVERY - 1) + [70.0]
    assert all(r.memory_used == 5 << 30 and r.power_w is None for r in later)


def test_a_device_nvml_does_not_know_gives_none_for_good(fake):
    reader = GpuReader(f"MIG-{UUID}")
    assert reader.read() is None and reader.read() is None
    assert fake.calls == ["init", ("handle", f"MIG-{UUID}"), "shutdown"]


def test_nvml_failing_to_start_gives_none_for_good(monkeypatch):
    nv = FakeNvml(fail=True)
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    reader = GpuReader(UUID)
    assert reader.read() is None and reader.read() is None and nv.calls == ["init"]


def test_a_failing_call_never_reaches_the_beacon(fake, monkeypatch):
    reader = GpuReader(UUID)
    assert reader.read() is not None
    monkeypatch.setattr(gpu_readings, "GpuReading", None)       # anything at all going wrong inside
    assert reader.read() is None


# ---- the broker's rendering ------------------------------------------------------------------

def beat(**kw) -> Heartbeat:
    return Heartbeat(worker_id=0, pid=10, sent=1.0, rss=1 << 26, cpu_s=1.0, fds=9, threads=4, batches=3, **kw)


FULL = GpuReading(memory_used=3 << 30, memory_total=80 << 30, utilization=0.42, temperature_c=61.0, power_w=250.5)
WORKERS = [
    SimpleNamespace(name="worker0[cuda:0]", device="cuda:0", beat=beat(gpu=FULL, gpu_ooms=2)),
    SimpleNamespace(name="worker1[cuda:1]", device="cuda:1", beat=beat(gpu=GpuReading(memory_used=1 << 30,
                                                                                       memory_total=40 << 30))),
    SimpleNamespace(name="worker2[cuda:1]", device="cuda:1", beat=beat()),    # NVML cannot say
    SimpleNamespace(name="worker3[cuda:2]", device="cuda:2", beat=None),      # no heartbeat yet
    SimpleNamespace(name="worker4[cpu]", device="cpu", beat=beat()),
]


def samples(fams) -> dict:
    return {(s.name, s.labels["worker"], s.labels["device"]): s.value for f in fams for s in f.samples}


def test_gpu_families_from_heartbeats():
    fams = list(gpu_families(WORKERS))
    assert [f.name for f in fams] == NAMES + ["tgw_worker_gpu_oom"]
    assert all(f.samples == [] for f in gpu_families(WORKERS[3:]))        # CPU, or no beat: families, no samples
    assert samples(fams) == {
        ("tgw_gpu_memory_used_bytes", "worker0[cuda:0]", "cuda:0"): 3 << 30,
        ("tgw_gpu_memory_total_bytes", "worker0[cuda:0]", "cuda:0"): 80 << 30,
        ("tgw_gpu_utilization_ratio", "worker0[cuda:0]", "cuda:0"): 0.42,
        ("tgw_gpu_temperature_celsius", "worker0[cuda:0]", "cuda:0"): 61.0,
        ("tgw_gpu_power_watts", "worker0[cuda:0]", "cuda:0"): 250.5,
        ("tgw_worker_gpu_oom_total", "worker0[cuda:0]", "cuda:0"): 2,
        # a device that reports memory alone: the other figures are left out
        ("tgw_gpu_memory_used_bytes", "worker1[cuda:1]", "cuda:1"): 1 << 30,
        ("tgw_gpu_memory_total_bytes", "worker1[cuda:1]", "cuda:1"): 40 << 30,
        ("tgw_worker_gpu_oom_total", "worker1[cuda:1]", "cuda:1"): 0,
        ("tgw_worker_gpu_oom_total", "worker2[cuda:1]", "cuda:1"): 0,
    }


def test_status_shows_gpu_workers_figures_and_none_for_cpu_workers():
    assert [gpu_status(w) for w in WORKERS] == [
        {"gpu": {"memory_used": 3 << 30, "memory_total": 80 << 30, "utilization": 0.42, "temperature_c": 61.0,
                 "power_w": 250.5}, "gpu_ooms": 2},
        {"gpu": {"memory_used": 1 << 30, "memory_total": 40 << 30, "utilization": None, "temperature_c": None,
                 "power_w": None}, "gpu_ooms": 0},
        {"gpu": None, "gpu_ooms": 0}, {}, {}]


def test_status_printout_has_a_gpu_line_per_gpu_worker(capsys):
    workers = [{"name": w.name, "pid": 10, "state": "ready", "inflight": 0, "rss": 1 << 26, "batches": 3,
                "heartbeat_age_s": 0.5, "restarts": 0, "benched": "", "last_death": "", **gpu_status(w)}
               for w in WORKERS]
    cli.print_status("ipc:///tmp/x.sock", StatusReply(v=PROTOCOL_VERSION, id=1, phase="serving", uptime_s=4.0,
                                                      workers=workers, models={}))
    lines = capsys.readouterr().out.splitlines()
    gpu = [line for line in lines if line.startswith("  gpu: ")]
    assert gpu == ["  gpu: 3.0/80.0 GiB, 42% busy, 61 °C, 250 W; 2 OOMs",
                   "  gpu: 1.0/40.0 GiB, -% busy, - °C, - W; 0 OOMs",
                   "  gpu: no NVML figures; 0 OOMs"]
    assert lines.index(gpu[0]) == 1 + [line.split()[0] for line in lines].index("worker0[cuda:0]")
