"""The worker's beacon: a thread that reports liveness and resource use, and answers leak snapshots.

It owns its own DEALER (identity: the worker's + b"~ctl") on the worker's zmq Context, so it never
touches the serving loop's socket (zmq sockets are not thread-safe) and keeps beating while a
forward runs (torch releases the GIL in ops). Silence is the broker's hang signal: a native
deadlock that holds the GIL stops the beats too, as intended.
"""
from __future__ import annotations

import logging
import os
import resource
import time
import tracemalloc

import torch
import zmq

from tgw.shm import gc_watch
from tgw.shm.wire import Heartbeat, LineGrowth, SnapshotRequest, WorkerSnapshot, encode, to_worker_decoder

from .device_identity import device_uuid
from .gpu_readings import GpuReader
from .progress import Progress
from .sidethread import SideThread

log = logging.getLogger("tgw.worker")
CTL_SUFFIX = b"~ctl"
TRACE_FRAMES = 4      # frames kept per traced allocation once a snapshot is asked for
_SKIP = [tracemalloc.Filter(False, tracemalloc.__file__)]  # the snapshots' own bookkeeping


class Beacon(SideThread):
    def __init__(self, ctx: zmq.Context, endpoint: str, identity: bytes, worker_id: int, progress: Progress,
                 heartbeat_s: float = 1.0, device: torch.device | None = None):
        self.worker_id, self.progress, self.heartbeat_s = worker_id, progress, heartbeat_s
        self.cuda = None
        if device is not None and device.type == "cuda":  # the index now: the current device is per thread
            self.cuda = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        # NVML's figures of this worker's own GPU, found by UUID (read in the beacon's thread)
        self.gpu = GpuReader(device_uuid(self.cuda)) if self.cuda is not None else None
        super().__init__(ctx, endpoint, identity + CTL_SUFFIX, "tgw-beacon")
        # opened now: a worker that ran out of fds can still report itself
        self._status = os.open("/proc/self/status", os.O_RDONLY | os.O_CLOEXEC)
        self._baseline: tracemalloc.Snapshot | None = None
        self._tracing_since, self._we_trace = 0.0, False

    def _run(self) -> None:
        poller = self.poller()
        next_beat = time.monotonic()
        try:
            while True:
                if time.monotonic() >= next_beat:
                    self._send(self.beat())
                    next_beat = time.monotonic() + self.heartbeat_s
                if not self.serve_once(poller, max(0, int((next_beat - time.monotonic()) * 1000))):
                    return
        finally:
            self._close()

    def _close(self) -> None:
        super()._close()
        os.close(self._status)
        if self._we_trace:
            tracemalloc.stop()

    def _send(self, msg) -> None:
        try:
            self.sock.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            pass  # the broker is not reading: it judges us by the beats it does get

    def beat(self) -> Heartbeat:
        status = _fields(os.pread(self._status, 8192, 0))
        t = os.times()
        batch_id = self.progress.batch_id
        beat = Heartbeat(worker_id=self.worker_id, pid=os.getpid(), sent=time.monotonic(),
                         rss=int(status[b"VmRSS"].split()[0]) * 1024, cpu_s=t.user + t.system,
                         fds=_count_fds(), threads=int(status[b"Threads"]), batches=self.progress.batches,
                         batch_id=batch_id, batch_since=self.progress.batch_since if batch_id is not None else 0.0,
                         output_used=self.progress.outputs.in_use if self.progress.outputs is not None else 0,
                         gpu_ooms=self.progress.gpu_ooms, rss_anon=int(status.get(b"RssAnon", b"0").split()[0]) * 1024,
                         gc=gc_watch.watch.as_dict())
        if self.cuda is not None:
            beat.cuda_allocated = torch.cuda.memory_allocated(self.cuda)
            beat.cuda_reserved = torch.cuda.memory_reserved(self.cuda)
            beat.gpu = self.gpu.read()    # None when NVML cannot say; never raises
        return beat

    def _answer(self) -> None:
        try:
            msg = to_worker_decoder.decode(self.sock.recv())
        except Exception as exc:  # a bad control message must not silence the beacon
            log.warning("undecodable control message ignored: %s", exc)
            return
        if not isinstance(msg, SnapshotRequest):
            log.warning("control socket got %s: ignored", type(msg).__name__)
            return
        try:
            self._send(self.snapshot(msg))
        except Exception:  # a failed snapshot is the broker's loss, not a reason to stop beating
            log.exception("snapshot %d failed", msg.snapshot_id)

    def snapshot(self, req: SnapshotRequest) -> WorkerSnapshot:
        """The first request starts tracing and takes the baseline; later ones report growth since."""
        growth = []
        if self._baseline is None:
            if not tracemalloc.is_tracing():
                tracemalloc.start(TRACE_FRAMES)
                self._we_trace = True
            self._tracing_since = time.monotonic()
            self._baseline = tracemalloc.take_snapshot().filter_traces(_SKIP)
        else:
            stats = tracemalloc.take_snapshot().filter_traces(_SKIP).compare_to(self._baseline, "lineno")
            growth = [LineGrowth(where=f"{s.traceback[0].filename}:{s.traceback[0].lineno}",
                                 size_diff=s.size_diff, count_diff=s.count_diff)
                      for s in stats if s.size_diff > 0][:req.top]
        return WorkerSnapshot(snapshot_id=req.snapshot_id, worker_id=self.worker_id,
                              tracing_since=self._tracing_since, traced_bytes=tracemalloc.get_traced_memory()[0],
                              growth=growth, cuda=_cuda_summary(self.cuda) if self.cuda is not None else {})


def _fields(status: bytes) -> dict[bytes, bytes]:
    return dict(line.split(b":", 1) for line in status.splitlines() if b":" in line)


def _count_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the one listdir itself opens
    except OSError:  # EMFILE: the table is full, which is the figure to report
        return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _cuda_summary(device: torch.device) -> dict:
    segments = [s for s in torch.cuda.memory_snapshot() if s.get("device", device.index) == device.index]
    return {"segments": len(segments), "total_size": sum(s["total_size"] for s in segments),
            "allocated_size": sum(s["allocated_size"] for s in segments),
            "active_blocks": sum(b["state"] == "active_allocated" for s in segments for b in s["blocks"])}
