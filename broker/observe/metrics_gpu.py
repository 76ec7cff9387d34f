"""GPU figures for /metrics: memory, utilisation, temperature and power of each GPU worker's
device, the CUDA out-of-memory errors its serving loop met, and each device's state and faults.

The broker reads no NVML for them: each GPU worker reads NVML for its own device, found by
UUID (workers/gpu_readings.py), and sends the figures in its heartbeat; the families show the
last heartbeat's, as `status` does (status.gpu_status). A CPU worker, and a GPU worker whose
NVML cannot start, adds no samples; a figure the device does not report is left out alone.
"""
from __future__ import annotations

from typing import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .devices import DEVICE_STATES, device_states
from .metrics_state import WORKER
from .status import BrokerView, gpu_status

# name, help, GpuReading field
READINGS: list[tuple[str, str, str]] = [
    ("tgw_gpu_memory_used_bytes", "Device memory in use, by every process on the worker's GPU, at its last "
     "heartbeat", "memory_used"),
    ("tgw_gpu_memory_total_bytes", "Device memory of the worker's GPU", "memory_total"),
    ("tgw_gpu_utilization_ratio", "Fraction of NVML's last sample period in which a kernel ran on the worker's "
     "GPU (0-1), at its last heartbeat", "utilization"),
    ("tgw_gpu_temperature_celsius", "Core temperature of the worker's GPU, at its last heartbeat", "temperature_c"),
    ("tgw_gpu_power_watts", "Power drawn by the worker's GPU board, at its last heartbeat", "power_w"),
]


def families(workers: Iterable) -> Iterator:
    """A family per reading and the OOM counter, with samples labelled (worker, device) from each
    worker's last heartbeat (`workers`: the roster, or anything with name, device and beat)."""
    fams = [GaugeMetricFamily(name, doc, labels=WORKER) for name, doc, _ in READINGS]
    ooms = CounterMetricFamily("tgw_worker_gpu_oom", "GPU workers: CUDA out-of-memory errors the worker met, "
                               "those recovered by splitting the batch included, from its last heartbeat "
                               "(restarts from 0 with a new process)", labels=WORKER)
    for w in workers:
        seen = gpu_status(w)
        if not seen:
            continue
        labels = [w.name, w.device]
        ooms.add_metric(labels, seen["gpu_ooms"])
        for fam, (_, _, field) in zip(fams, READINGS):
            figure = (seen.get("gpu") or {}).get(field)
            if figure is not None:
                fam.add_metric(labels, float(figure))
    yield from fams
    yield ooms


def device_families(view: BrokerView) -> Iterator:
    """Each device's state (devices.py) one-hot, and the sticky CUDA errors met on it."""
    state = GaugeMetricFamily("tgw_device_state", "The device's state (1 for the current one): serving, starting, "
                              "restarting, faulted (its worker met a sticky CUDA error and is being replaced), "
                              "out_of_service (repeated faults: no worker starts there for a while)",
                              labels=["device", "uuid", "state"])
    faults = CounterMetricFamily("tgw_worker_cuda_faults", "Sticky CUDA errors (illegal memory access, "
                                 "device-side assert, launch failure, ECC, ...) that ended a worker on the device "
                                 "since the broker started", labels=["device", "uuid"])
    for device, d in device_states(view).items():
        for s in DEVICE_STATES:
            state.add_metric([device, d["uuid"], s], 1.0 if s == d["state"] else 0.0)
        faults.add_metric([device, d["uuid"]], d["faults"])
    yield state
    yield faults
