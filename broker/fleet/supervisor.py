"""Supervisor (inside the broker process): plans, spawns, watches, restarts and stops workers.

It creates and alone unlinks each worker's segment; at start it sweeps segments whose creator
is dead and checks /dev/shm has room for every ring.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections import deque

from tgw.shm import segment as shm_segment
from tgw.shm.segment import Segment, ShmError

from tgw.broker.config.load import SupervisorDecl, WorkersDecl
from .gpus import plan_devices
from tgw.broker.state.pool import WorkerHandle, WorkerState

log = logging.getLogger("tgw.supervisor")
RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0)


def exit_reason(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


def plan_cpus(n_workers: int, threads: int, pin: bool) -> list[list[int]]:
    """Each worker its own cores (round-robin over the cores this process may use)."""
    if not pin:
        return [[] for _ in range(n_workers)]
    cores = sorted(os.sched_getaffinity(0))
    return [[cores[(w * threads + t) % len(cores)] for t in range(threads)] for w in range(n_workers)]


class Supervisor:
    def __init__(self, decl: WorkersDecl, watch: SupervisorDecl, endpoint: str):
        self.decl, self.watch, self.endpoint = decl, watch, endpoint
        self.devices = plan_devices(decl)           # one worker each (NVML is asked once, here)
        self.workers: list[WorkerHandle] = []
        self._restarts: dict[int, int] = {}         # consecutive restarts, for the backoff
        self._restart_at: dict[int, float] = {}
        self._deaths: dict[int, deque] = {}         # recent death times, for the crash-loop guard

    def prepare(self) -> list[str]:
        """Sweep stale segments and create one ring per planned worker; returns swept names."""
        swept = shm_segment.sweep_stale()
        devices = self.devices
        in_b, out_b = self.decl.input_bytes, self.decl.output_bytes
        need, free = len(devices) * (in_b + out_b), shm_segment.free_bytes()
        sizes = (f"input {in_b >> 20} MiB (workers.input_arena_mb: {self.decl.input_arena_mb}) + output "
                 f"{out_b >> 20} MiB (workers.output_arena_mb: {self.decl.output_arena_mb})")
        if need > free:
            raise ShmError(28, f"{len(devices)} worker rings need {need >> 20} MiB in {shm_segment.SHM_DIR} "
                           f"but only {free >> 20} MiB is free; each is {sizes}: set smaller "
                           "workers.input_arena_mb/output_arena_mb or enlarge /dev/shm (docker run --shm-size)")
        log.info("%d worker ring(s), each %s", len(devices), sizes)
        cpus = plan_cpus(len(devices), self.decl.threads_per_worker, self.decl.pin_cpus)
        for i, device in enumerate(devices):
            seg = Segment.create(shm_segment.new_name("ring"), in_b + out_b)
            self.workers.append(WorkerHandle(i, device, cpus[i], seg, in_b, out_b))
        return swept

    def spawn_successor(self, old: WorkerHandle) -> WorkerHandle:
        """A new worker for old's device and cores, with a ring of its own, spawned now; old
        keeps serving until the lifecycle retires it."""
        seg = Segment.create(shm_segment.new_name("ring"), old.input_bytes + old.output_bytes)
        new = WorkerHandle(max(w.worker_id for w in self.workers) + 1, old.device, old.cpus, seg,
                           old.input_bytes, old.output_bytes)
        self.workers.append(new)
        self.spawn(new)
        old.successor = new
        log.warning("%s is being recycled: %s starts in its place", old.name, new.name)
        return new

    def forget(self, w: WorkerHandle) -> None:
        """A retired worker has exited: its ring goes, and it is not restarted."""
        self.workers.remove(w)
        self._restarts.pop(w.worker_id, None)
        self._deaths.pop(w.worker_id, None)
        w.segment.close()
        w.segment.unlink()
        log.info("%s retired", w.name)

    def spawn(self, w: WorkerHandle) -> None:
        cmd = [sys.executable, "-m", "tgw.workers", "--worker-id", str(w.worker_id),
               "--identity", w.identity.decode(), "--device", w.device, "--segment", w.segment.name,
               "--input-bytes", str(w.input_bytes), "--output-bytes", str(w.output_bytes),
               "--endpoint", self.endpoint, "--threads", str(self.decl.threads_per_worker),
               "--cpus", ",".join(map(str, w.cpus)), "--heartbeat-s", str(self.watch.heartbeat_s),
               "--preload", ",".join(self.decl.preload), "--cuda-host-memory", self.decl.cuda_host_memory]
        w.spawned(subprocess.Popen(cmd, stdin=subprocess.DEVNULL), time.monotonic())
        log.info("spawned %s pid %d", w.name, w.pid, extra={"event": "worker_spawned", "worker": w.name,
                                                             "pid": w.pid})

    def spawn_all(self) -> list[WorkerHandle]:
        for w in self.workers:
            self.spawn(w)
        return list(self.workers)

    def kill(self, w: WorkerHandle, reason: str) -> None:
        """SIGKILL a live worker (ours, by PID) that stopped serving; reap() then sees it dead."""
        if w.proc is None or w.proc.poll() is not None or w.kill_reason:
            return
        log.error("%s pid %d: %s; killing it", w.name, w.pid, reason,
                  extra={"event": "worker_kill", "worker": w.name, "pid": w.pid, "reason": reason})
        w.kill_reason = reason
        w.proc.kill()

    def reap(self) -> list[WorkerHandle]:
        """Workers whose process has exited since the last look (now DEAD). A worker that
        reached READY has its backoff forgiven and is no longer benched (a successful start);
        its deaths still count for the crash-loop guard until they leave the window."""
        out = []
        for w in self.workers:
            if w.state is WorkerState.READY and (self._restarts.get(w.worker_id) or w.benched):
                self._restarts[w.worker_id] = 0
                w.benched = ""
            if w.proc is not None and w.state is not WorkerState.DEAD and w.proc.poll() is not None:
                w.last_death = w.kill_reason or exit_reason(w.proc.returncode)
                log.warning("%s pid %d ended: %s", w.name, w.pid, w.last_death,
                            extra={"event": "worker_died", "worker": w.name, "pid": w.pid, "reason": w.last_death})
                w.exited()
                out.append(w)
        return out

    def schedule_restart(self, w: WorkerHandle) -> None:
        """Give a dead worker a fresh ring now and its process after a backoff (a long one, and
        its models benched on it, when it is crash-looping)."""
        w.segment.close()
        w.segment.unlink()
        w.renew(Segment.create(shm_segment.new_name("ring"), w.input_bytes + w.output_bytes))
        now, loop = time.monotonic(), self.watch.crash_loop
        deaths = self._deaths.setdefault(w.worker_id, deque())
        deaths.append(now)
        while deaths and deaths[0] < now - loop.window_s:
            deaths.popleft()
        n = self._restarts.get(w.worker_id, 0)
        self._restarts[w.worker_id] = n + 1
        w.restarts += 1
        delay = RESTART_BACKOFF_S[min(n, len(RESTART_BACKOFF_S) - 1)]
        if len(deaths) >= loop.deaths:
            w.benched = (f"crash loop: {w.name} died {len(deaths)} times in {loop.window_s:g} s "
                         f"(last: {w.last_death}); next start in {loop.backoff_s:g} s")
            log.error("%s", w.benched, extra={"event": "crash_loop", "worker": w.name, "deaths": len(deaths),
                                              "backoff_s": loop.backoff_s})
            delay = max(delay, loop.backoff_s)
        self._restart_at[w.worker_id] = now + delay

    def due_restarts(self) -> list[WorkerHandle]:
        """Spawn the dead workers whose backoff has run out; returns them."""
        now = time.monotonic()
        due = [w for w in self.workers if w.state is WorkerState.DEAD and self._restart_at.get(w.worker_id, now + 1) <= now]
        for w in due:
            del self._restart_at[w.worker_id]
            self.spawn(w)
        return due

    def all_ready(self) -> bool:
        return all(w.state is WorkerState.READY for w in self.workers)

    def first_dead(self) -> WorkerHandle | None:
        return next((w for w in self.workers if w.state is WorkerState.DEAD), None)

    def stop(self, grace_s: float = 10.0) -> None:
        """Wait for workers to exit (after the broker sent Stop), then force; unlink every ring."""
        deadline = time.monotonic() + grace_s
        for w in self.workers:
            if w.proc is None:
                continue
            try:
                w.proc.wait(max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.terminate()
                try:
                    w.proc.wait(3)
                except subprocess.TimeoutExpired:
                    w.proc.kill()
                    w.proc.wait()
        for w in self.workers:
            try:
                w.segment.close()
            except BufferError:
                pass
            w.segment.unlink()
