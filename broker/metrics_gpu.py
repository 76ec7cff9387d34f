"""GPU figures for /metrics from NVML (nvidia-ml-py; the broker has no torch): memory, utilisation,
temperature and power of each device a worker runs on.

NVML is initialised at the first scrape that has a GPU worker, once: where it fails (no driver,
no library, a CPU-only box) the failure is remembered and the families stay empty, without an
error. A reading a device does not support (power on some boards) is left out alone.
"""
from __future__ import annotations

import logging
from typing import Callable

from prometheus_client.core import GaugeMetricFamily

log = logging.getLogger("tgw.broker")

# name, help, reading(pynvml, handle) -> value
READINGS: list[tuple[str, str, Callable]] = [
    ("tgw_gpu_memory_used_bytes", "Device memory in use, by every process on the GPU",
     lambda nv, h: nv.nvmlDeviceGetMemoryInfo(h).used),
    ("tgw_gpu_memory_total_bytes", "Device memory of the GPU", lambda nv, h: nv.nvmlDeviceGetMemoryInfo(h).total),
    ("tgw_gpu_utilization_ratio", "Fraction of the last sample period in which a kernel ran on the GPU (0-1)",
     lambda nv, h: nv.nvmlDeviceGetUtilizationRates(h).gpu / 100),
    ("tgw_gpu_temperature_celsius", "GPU core temperature",
     lambda nv, h: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
    ("tgw_gpu_power_watts", "Power drawn by the GPU board", lambda nv, h: nv.nvmlDeviceGetPowerUsage(h) / 1000),
]


class Nvml:
    def __init__(self) -> None:
        self._lib = None     # the pynvml module once initialised; False once that failed

    def lib(self):
        if self._lib is None:
            try:
                import pynvml
                pynvml.nvmlInit()
                self._lib = pynvml
            except Exception as exc:  # no driver or library: no GPU figures, and that is all
                log.info("NVML unavailable: /metrics has no GPU figures (%s)", exc)
                self._lib = False
        return self._lib or None

    def families(self, devices: list[str]) -> list[GaugeMetricFamily]:
        """One family per reading, a sample per device ("cuda:N", NVML's index N) that answers it."""
        fams = [GaugeMetricFamily(name, doc, labels=["device"]) for name, doc, _ in READINGS]
        nv = self.lib() if devices else None
        for device in devices if nv is not None else ():
            try:
                handle = nv.nvmlDeviceGetHandleByIndex(int(device.split(":", 1)[1]))
            except Exception:  # noqa: BLE001 - a device NVML does not know: nothing to show for it
                continue
            for fam, (_, _, read) in zip(fams, READINGS):
                try:
                    fam.add_metric([device], float(read(nv, handle)))
                except Exception:  # noqa: BLE001 - not supported on this device
                    continue
        return fams
