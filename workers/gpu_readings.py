"""The GPU figures of a worker's heartbeat, from NVML (nvidia-ml-py): memory, utilisation,
temperature and power of the worker's own device.

The device is found by its UUID, never by an index: torch's cuda:N counts the devices that
CUDA_VISIBLE_DEVICES leaves, in CUDA_DEVICE_ORDER, and NVML's index N counts every device in
PCI order, so the two name different GPUs on many boxes. NVML is initialised at the first
reading, once: where that fails (no library, no driver, a CPU-only box) or the device is not
found, the failure is logged once at INFO and every reading after is None, without a retry.
A figure the device does not support (power on some boards, utilisation of a MIG instance)
is None, and is not asked again. Nothing here raises into the beacon.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from tgw.shm.wire_worker import GpuReading

log = logging.getLogger("tgw.worker")

# Memory and utilisation are read at every beat (the driver keeps them: a call is microseconds).
# Temperature and power come from the board's sensors, which some boards answer slowly (a
# management-bus round trip), and they move slowly: they are read at every SLOW_EVERY-th
# beat, and the last figures are sent in between.
SLOW_EVERY = 5


def nvml_uuids(uuid: str) -> list[str]:
    """NVML's spellings of a UUID as torch gives it: "GPU-…" as it is; a bare one (torch prints
    no prefix in some versions) as a GPU's, then as a MIG instance's."""
    uuid = uuid.strip()
    prefix = uuid[:4].upper()
    if prefix in ("GPU-", "MIG-"):
        return [prefix + uuid[4:]]
    return [f"GPU-{uuid}", f"MIG-{uuid}"] if uuid else []


class GpuReader:
    """Readings of the one device with `uuid` (workers/cuda_ipc.device_uuid), for one thread."""

    def __init__(self, uuid: str):
        self.uuid = uuid
        self.failed = False        # NVML or the device unavailable: None for good
        self._nv: Any = None       # the pynvml module, once initialised
        self._handle: Any = None
        self._unsupported: set[str] = set()
        self._beats = 0
        self._slow: tuple[float | None, float | None] = (None, None)   # temperature, power

    def read(self) -> GpuReading | None:
        """This beat's figures; None when NVML cannot say anything about the device."""
        if self._handle is None and not self._open():
            return None
        try:
            nv, h = self._nv, self._handle
            memory = self._ask("memory", lambda: nv.nvmlDeviceGetMemoryInfo(h))
            utilization = self._ask("utilization", lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu / 100)
            if self._beats % SLOW_EVERY == 0:
                self._slow = (self._ask("temperature",
                                        lambda: float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))),
                              self._ask("power", lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000))   # milliwatts
            self._beats += 1
            reading = GpuReading(memory_used=int(memory.used) if memory is not None else None,
                                 memory_total=int(memory.total) if memory is not None else None,
                                 utilization=utilization, temperature_c=self._slow[0], power_w=self._slow[1])
        except Exception:  # noqa: BLE001 - a figure is not worth a silent beacon
            log.debug("GPU reading of %s failed", self.uuid, exc_info=True)
            return None
        return reading if reading != GpuReading() else None

    def _open(self) -> bool:
        if self.failed:
            return False
        try:
            import pynvml
            pynvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001 - no library or driver: no GPU figures, and that is all
            return self._give_up(f"NVML unavailable ({exc})")
        self._nv = pynvml
        for uuid in nvml_uuids(self.uuid):
            try:
                self._handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
                return True
            except Exception:  # noqa: BLE001 - not this spelling, or not a device NVML knows
                continue
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
        return self._give_up(f"NVML knows no device {self.uuid!r}")

    def _give_up(self, why: str) -> bool:
        self.failed = True
        log.info("%s: heartbeats carry no GPU figures", why)
        return False

    def _ask(self, what: str, call: Callable[[], Any]) -> Any:
        """call()'s answer, or None: a figure the device does not support is not asked again."""
        if what in self._unsupported:
            return None
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - NVMLError: unsupported, or a passing failure
            code = getattr(exc, "value", None)
            if code is not None and code == getattr(self._nv, "NVML_ERROR_NOT_SUPPORTED", None):
                self._unsupported.add(what)
                log.info("GPU %s: NVML does not report its %s", self.uuid, what)
            return None
