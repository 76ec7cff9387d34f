"""Supervisor (inside the broker process): plans, spawns, watches, restarts and stops workers.

It creates and alone unlinks each worker's segment; at start it sweeps segments whose creator
is dead and checks /dev/shm has room for every ring. Its `workers` is the one roster: it alone
adds and removes workers there; the broker's serving core reads the same list (Broker.roster).
Each worker starts from one WorkerStart (tgw/shm/wire_start.py), its only argument.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from typing import Any, Callable

from tgw.shm import segment as shm_segment
from tgw.shm.segment import Segment, ShmError
from tgw.shm.wire_start import WorkerStart, encode_start

from tgw.broker.config.load import SupervisorDecl, WorkersDecl
from tgw.broker.models.roles import roles_for
from tgw.broker.state.pool import WorkerHandle, WorkerState
from .gpus import mig_instances, plan_devices
from .restarts import Restarts

log = logging.getLogger("tgw.supervisor")


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
    def __init__(self, decl: WorkersDecl, watch: SupervisorDecl, endpoint: str, *, log_format: str = "text",
                 slow_ms: float | None = None, tracing: dict[str, Any] | None = None, gc_freeze: bool = False,
                 clock: Callable[[], float] = time.monotonic):
        """`log_format`, `slow_ms`, `tracing`: what the workers log and trace (their WorkerStart);
        `gc_freeze`: server.gc_freeze, which the workers are told and the lifecycle reads too."""
        self.decl, self.watch, self.endpoint, self.clock = decl, watch, endpoint, clock
        self.gc_freeze = gc_freeze
        self.observe = {"log_format": log_format, "slow_ms": slow_ms, "tracing": tracing}
        # one worker each (NVML is asked once, here), then workers.stage_workers CPU workers for stages
        self.devices = plan_devices(decl) + ["cpu"] * decl.stage_workers
        self.roles = roles_for(self.devices[:len(self.devices) - decl.stage_workers], decl.stage_workers)
        self.mig = mig_instances(self.devices)   # cuda:N -> MIG-uuid: its workers see that instance alone
        self.workers: list[WorkerHandle] = []       # the roster: changed in place only (the broker holds it)
        self.restarts = Restarts(watch.crash_loop)  # backoff and the crash-loop guard
        self._restart_at: dict[int, float] = {}     # worker id -> when its next life starts
        # device -> until when no worker may start on it (the CUDA fault rule's; faults.py)
        self.hold: Callable[[str], float | None] = lambda device: None

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
        log.info("%d worker ring(s) (%d for stages), each %s", len(devices), self.decl.stage_workers, sizes)
        cpus = plan_cpus(len(devices), self.decl.threads_per_worker, self.decl.pin_cpus)
        for i, device in enumerate(devices):
            seg = Segment.create(shm_segment.new_name("ring"), in_b + out_b)
            self.workers.append(WorkerHandle(i, device, cpus[i], seg, in_b, out_b, role=self.roles[i]))
        return swept

    def spawn_successor(self, old: WorkerHandle) -> WorkerHandle:
        """A new worker for old's device and cores, with a ring of its own, spawned now; old
        keeps serving until the lifecycle retires it."""
        seg = Segment.create(shm_segment.new_name("ring"), old.input_bytes + old.output_bytes)
        new = WorkerHandle(max(w.worker_id for w in self.workers) + 1, old.device, old.cpus, seg,
                           old.input_bytes, old.output_bytes, role=old.role)
        self.workers.append(new)
        self.spawn(new)
        old.replaced_by(new)
        log.warning("%s is being recycled: %s starts in its place", old.name, new.name)
        return new

    def forget(self, w: WorkerHandle) -> None:
        """A retired worker has exited: its ring goes, and it is not restarted."""
        self.workers.remove(w)
        self.restarts.forget(w.worker_id)
        w.segment.close()
        w.segment.unlink()
        log.info("%s retired", w.name)

    def start_for(self, w: WorkerHandle) -> WorkerStart:
        """What (this life of) `w` is told at its start."""
        return WorkerStart(worker_id=w.worker_id, identity=w.identity.decode(), segment=w.segment.name,
                           input_bytes=w.input_bytes, output_bytes=w.output_bytes, endpoint=self.endpoint,
                           device="cuda:0" if w.device in self.mig else w.device,
                           threads=self.decl.threads_per_worker, cpus=list(w.cpus),
                           heartbeat_s=self.watch.heartbeat_s, preload=list(self.decl.preload),
                           host_memory=self.decl.cuda_host_memory, gc_freeze=self.gc_freeze, **self.observe)

    def spawn(self, w: WorkerHandle) -> None:
        cmd = [sys.executable, "-m", "tgw.workers", encode_start(self.start_for(w))]
        self.restarts.spawned(w.worker_id)
        w.spawned(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=self.spawn_env(w)), self.clock())
        log.info("spawned %s pid %d", w.name, w.pid, extra={"event": "worker_spawned", "worker": w.name,
                                                             "pid": w.pid})

    def spawn_env(self, w: WorkerHandle) -> dict[str, str] | None:
        """The environment of `w`'s process: the broker's (None), but only its MIG instance visible."""
        mig = self.mig.get(w.device)
        return None if mig is None else {**os.environ, "CUDA_VISIBLE_DEVICES": mig}

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
        w.killing(reason)
        w.proc.kill()

    def ready(self, w: WorkerHandle) -> None:
        """The handshake made `w` ready (its life's uptime is judged from here; see restarts.py)."""
        self.restarts.ready(w.worker_id, self.clock())

    def any_exited(self) -> bool:
        """Some worker's process ended and reap() has not seen it yet."""
        return any(w.proc is not None and w.state is not WorkerState.DEAD and w.proc.poll() is not None
                   for w in self.workers)

    def reap(self) -> list[WorkerHandle]:
        """Workers whose process has exited since the last look (now DEAD). A worker that
        reached READY is no longer benched (a successful start); whether its death counts for
        the crash-loop guard depends on how long it served (restarts.py)."""
        out = []
        for w in self.workers:
            if w.state is WorkerState.READY:
                self.restarts.ready(w.worker_id, self.clock())   # no-op once the handshake said so
                w.unbench()
            if w.proc is not None and w.state is not WorkerState.DEAD and w.proc.poll() is not None:
                w.exited(w.faulted or w.kill_reason or exit_reason(w.proc.returncode))
                log.warning("%s pid %d ended: %s", w.name, w.pid, w.last_death,
                            extra={"event": "worker_died", "worker": w.name, "pid": w.pid, "reason": w.last_death})
                out.append(w)
        return out

    def schedule_restart(self, w: WorkerHandle) -> None:
        """Give a dead worker a fresh ring now and its process after a backoff (a long one, and
        its models benched on it, when it is crash-looping)."""
        w.segment.close()
        w.segment.unlink()
        w.renew(Segment.create(shm_segment.new_name("ring"), w.input_bytes + w.output_bytes))
        now, loop = self.clock(), self.watch.crash_loop
        delay, looping = self.restarts.died(w.worker_id, now)
        if looping:
            w.bench(f"crash loop: {w.name} died {looping} times in {loop.window_s:g} s "
                    f"(last: {w.last_death}), each before it served; next start in {delay:g} s")
            log.error("%s", w.benched, extra={"event": "crash_loop", "worker": w.name, "deaths": looping,
                                              "backoff_s": delay})
        self._restart_at[w.worker_id] = max(now + delay, self._held(w) or 0.0)

    def _held(self, w: WorkerHandle) -> float | None:
        """Until when `w`'s device is out of service (benched meanwhile), None if it is not."""
        until = self.hold(w.device)
        if until is not None:
            w.bench(f"{w.device} out of service (repeated CUDA faults): next start in {until - self.clock():.0f} s")
        return until

    def restart_at(self, w: WorkerHandle) -> float | None:
        """When a dead worker's next life is due (the supervisor's clock), None if none is."""
        return self._restart_at.get(w.worker_id)

    def due_restarts(self) -> list[WorkerHandle]:
        """Spawn the dead workers whose backoff has run out; returns them."""
        now = self.clock()
        due = [w for w in self.workers if w.state is WorkerState.DEAD and self._restart_at.get(w.worker_id, now + 1) <= now]
        for w in due:
            held = self._held(w)   # a fault after its restart was scheduled may hold its device now
            if held is not None:
                self._restart_at[w.worker_id] = held
                continue
            del self._restart_at[w.worker_id]
            self.spawn(w)
        return [w for w in due if w.worker_id not in self._restart_at]

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
