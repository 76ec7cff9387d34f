"""Sticky CUDA errors (workers/cuda_faults.py): a faulted worker is poisoned, not its request.

On a worker's WorkerFault the broker takes no new batch to it (it is told to stop) and the
lifecycle kills it if it has not exited by itself; its death then retries what it held once,
alone, on a healthy worker (fleet/handshake.py: the request in flight at a second death is
the one blamed, and answered, never run again), and its next life is a new process with a new
CUDA context. Each fault is recorded (device, UUID, error, the batch's requests by fingerprint)
in status, the log, /metrics and a snapshot file.

The crash-loop rule per device: `cuda_faults.faults` faults on one device within `window_s`
take the device out of service for `out_of_service_s` (its worker is not started again until
then, and health says which capacity is missing); then one worker starts again as a probe.
This module alone writes the fault records and the out-of-service table.
"""
from __future__ import annotations

import logging
import time
from collections import Counter, deque
from typing import Callable

from tgw.shm.wire import WorkerFault

from tgw.broker.config.load import CudaFaultDecl
from tgw.broker.state.pool import WorkerHandle
from .handshake import fingerprint

log = logging.getLogger("tgw.supervisor")
RECORDS_KEPT = 50
SUSPECTS_KEPT = 16   # fingerprints recorded of a faulted batch's requests
FAULT_PREFIX = "sticky CUDA error"   # how a faulted worker's end begins (WorkerHandle.faulted, last_death)


class CudaFaults:
    def __init__(self, decl: CudaFaultDecl, clock: Callable[[], float] = time.monotonic,
                 write: Callable[[WorkerHandle, dict], str | None] = lambda w, record: None):
        self.decl, self.clock, self.write = decl, clock, write   # write: the snapshot file (snapshots.py)
        self.records: deque[dict] = deque(maxlen=RECORDS_KEPT)   # the latest faults, oldest first
        self.counts: Counter = Counter()                          # (device, uuid) -> faults since start
        self._times: dict[str, deque] = {}                        # device -> fault times within the window
        self.out_until: dict[str, float] = {}                     # device -> out of service until (clock)
        self.out_reason: dict[str, str] = {}
        self._probe_since: dict[str, float] = {}                  # device -> when it came back as a probe
        self.to_kill: list[WorkerHandle] = []   # poisoned workers the lifecycle ends (ours, by PID)

    def on_fault(self, w: WorkerHandle, msg: WorkerFault) -> dict:
        """Poison `w`: no new batch goes to it; record the fault; judge its device."""
        now = self.clock()
        batch = w.inflight.get(msg.batch_id) if msg.batch_id is not None else None
        requests = list(batch.requests) if batch is not None else []
        # a retry runs alone (fleet/handshake.py): at its fault, that one input is to blame
        blamed = fingerprint(requests[0]) if len(requests) == 1 and requests[0].alone else None
        w.met_fault(f"{FAULT_PREFIX} ({msg.kind}): {msg.error}")   # routing takes no new batch to it
        self.to_kill.append(w)
        self.counts[w.device, w.device_uuid] += 1
        record = {"at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "worker": w.name, "pid": w.pid, "device": w.device,
                  "uuid": w.device_uuid, "kind": msg.kind, "error": msg.error, "batch_id": msg.batch_id,
                  "blamed": blamed, "suspects": [fingerprint(p) for p in requests[:SUSPECTS_KEPT]],
                  "in_flight": sum(len(b.requests) for b in w.inflight.values())}
        log.error("%s pid %d: sticky CUDA error on %s%s: %s; replacing it, its %d request(s) in flight retried "
                  "alone%s", w.name, w.pid, w.device, f" ({w.device_uuid})" if w.device_uuid else "", msg.error,
                  record["in_flight"], f"; blamed: {blamed}" if blamed else "",
                  extra={"event": "cuda_fault", **{k: v for k, v in record.items() if k != "at"}})
        self._judge(w.device, now)
        record["device_out_of_service"] = w.device in self.out_until
        self.records.append(record)
        record["snapshot"] = self.write(w, record)
        return record

    def _judge(self, device: str, now: float) -> None:
        times = self._times.setdefault(device, deque())
        times.append(now)
        while times and times[0] < now - self.decl.window_s:
            times.popleft()
        probing = now - self._probe_since.get(device, float("-inf")) < self.decl.window_s
        if len(times) < self.decl.faults and not probing:
            return
        self.out_until[device] = now + self.decl.out_of_service_s
        self.out_reason[device] = (f"{len(times)} sticky CUDA error(s) on {device} within {self.decl.window_s:g} s "
                                   f"(supervisor.cuda_faults.faults: {self.decl.faults})" +
                                   (", the last one on the probe after a time out of service" if probing else ""))
        log.error("%s out of service for %g s: %s", device, self.decl.out_of_service_s, self.out_reason[device],
                  extra={"event": "device_out_of_service", "device": device, "faults": len(times),
                         "out_of_service_s": self.decl.out_of_service_s})

    def held_until(self, device: str) -> float | None:
        """Until when no worker may start on `device` (None: it may now). Once its time out of
        service is over, its next worker is a probe: one fault within window_s takes it out again."""
        until = self.out_until.get(device)
        if until is None:
            return None
        now = self.clock()
        if until > now:
            return until
        del self.out_until[device]
        self._probe_since[device] = now
        log.warning("%s back in service after %g s out: its worker starts again as a probe", device,
                    self.decl.out_of_service_s, extra={"event": "device_probe", "device": device})
        return None

    def out_of_service(self) -> dict[str, dict]:
        """Device -> why it is out and for how long still (status, health, /metrics)."""
        now = self.clock()
        return {d: {"reason": self.out_reason.get(d, ""), "left_s": round(until - now, 3)}
                for d, until in self.out_until.items() if until > now}

    def as_dict(self) -> dict:
        by_device: Counter = Counter()
        for (device, _), n in self.counts.items():
            by_device[device] += n
        return {"total": sum(self.counts.values()), "by_device": dict(by_device),
                "out_of_service": self.out_of_service(), "recent": list(self.records)}
