"""The broker process over time: start workers and wait for them, watch them while serving,
drain and stop.

The only place that moves the broker between phases and connects the supervisor (processes,
rings, restarts; it alone changes the roster both read) with the serving core (routing,
queues): the supervisor reaps a dead worker, the broker takes back its requests, the
supervisor schedules its restart, the broker routes to the new process once spawned.

Start-up waits on events, not on an interval: a worker's ready or failed handshake, a worker
process's exit (its pidfd, fleet/exits.py), a stop signal, or the start timeout.

Stopping has two steps: with server.drain_notice_s, the first SIGTERM/SIGINT starts the notice
(phase draining: health says not ready so balancers stop sending, while every request is still
taken and served); then the drain (phase stopping: new requests refused, queued and in-flight
ones finish within shutdown_grace_s). A second signal ends the notice; one more stops waiting
for the drain.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import time

import psutil
from collections.abc import Callable

from tgw.shm import gc_watch
from tgw.shm.segment import ShmError

from tgw.broker.config.startup import StartupError
from tgw.broker.fleet.exits import ExitWatch
from tgw.broker.fleet.hangs import HangJudge
from tgw.broker.fleet.supervisor import Supervisor
from tgw.broker.fleet.systemd import sd_notify
from tgw.broker.state.pool import WorkerHandle, WorkerState

from .broker import Broker
from .phase import Phase

log = logging.getLogger("tgw.broker")
MONITOR_S = 0.05  # serving: deadlines, hangs, restarts due (start-up waits on events instead)
WATCHDOG_S = 1.0  # systemd's WatchdogSec is tens of seconds: one ping a second is plenty


class Lifecycle:
    def __init__(self, broker: Broker, supervisor: Supervisor, start_timeout_s: float, grace_s: float,
                 notice_s: float, hangs: HangJudge):
        """`start_timeout_s`: workers.start_timeout_s; `grace_s`: supervisor.shutdown_grace_s;
        `notice_s`: server.drain_notice_s."""
        self.broker, self.supervisor, self.serving = broker, supervisor, broker.serving
        self.start_timeout_s, self.grace_s, self.notice_s = start_timeout_s, grace_s, notice_s
        self.load = broker.load   # refreshed on each look (observe/load.py)
        self.hangs = hangs
        self.stop_event = asyncio.Event()    # first SIGTERM/SIGINT: the notice (if any), drain, then stop
        self.skip_event = asyncio.Event()    # a second one during the notice: drain now
        self.force_event = asyncio.Event()   # one more (a second, without a notice): stop now
        self._last_ping = 0.0
        self.changed = asyncio.Event()       # a worker became ready, failed, or exited: look again
        self.exits: ExitWatch | None = None  # made on the loop, in run
        self.stop_signal: str | None = None  # the first stop signal's name, for the stop line
        self.serving_since: float | None = None
        self.cut_short = 0                   # requests answered MODEL_NOT_READY at the stop
        broker.handshake.on_ready = self._on_ready
        supervisor.hold = broker.faults.held_until   # a device out of service starts no worker
        broker.handshake.on_failed = self._on_failed
        self.fronts = broker.fronts   # fronts/fleet.FrontFleet, or None without front processes
        if self.fronts is not None:
            self.fronts.on_hello = self.changed.set   # start-up waits for every front's HELLO too

    def on_stop_signal(self, signum: int | None = None) -> None:
        if self.stop_signal is None and signum is not None:
            self.stop_signal = signal.Signals(signum).name
        if self.stop_event.is_set() and self.broker.phase.now is Phase.DRAINING and not self.skip_event.is_set():
            log.warning("second stop signal: ending the drain notice, draining now")
            self.skip_event.set()
        elif self.stop_event.is_set():
            log.warning("second stop signal: not waiting for the drain")
            self.force_event.set()
        self.stop_event.set()
        self.changed.set()

    def _on_ready(self, w: WorkerHandle) -> None:
        self.supervisor.ready(w)
        self.changed.set()

    def _on_failed(self, w: WorkerHandle) -> None:
        self.changed.set()

    def _on_exit(self) -> None:
        """A worker process exited: its last messages first (a load failure names the cause
        better than its exit code), while its route stands; then reap it now."""
        self.broker.back.drain()
        self._step()

    def _enrol(self, w: WorkerHandle) -> None:
        """A new life of `w` was spawned: route to it, and wake on its exit."""
        self.serving.add_worker(w)
        if self.exits is not None:
            self.exits.add(w.proc)

    def on_snapshot_signal(self) -> None:
        log.info("SIGUSR1: memory snapshot of every live worker")
        self.broker.memory.snapshot_all(self.broker.roster, "SIGUSR1", time.monotonic())

    async def run(self, address: str) -> None:
        """Start, serve until stop_event, drain; the caller stops workers and closes sockets."""
        self.exits = ExitWatch(asyncio.get_running_loop(), self._on_exit)
        monitor = asyncio.create_task(self._monitor())
        try:
            for w in self.supervisor.spawn_all():
                self._enrol(w)
            if self.fronts is not None:
                for proc in self.fronts.spawn_all():
                    self.exits.add(proc)
            if not await self._wait_ready():
                log.info("stopped during start-up")
                return
            if self.supervisor.gc_freeze:   # workers warm, faces up: what lives now lives for good
                gc_watch.watch.freeze()     # (before the phase turns serving: its one full collection delays no request)
            else:
                gc_watch.watch.reset_longest()   # either way, status' longest pause is one met while serving
            self._enter(self.broker.start_serving)
            self._log_start(address)
            sd_notify(f"READY=1\nSTATUS=serving on {address}")
            await self.stop_event.wait()
            sd_notify("STOPPING=1")
            await self._notice()
            await self._drain()
        finally:
            monitor.cancel()
            self.exits.close()

    def _log_start(self, address: str) -> None:
        """The start line: where it serves, what, on how many workers, how long the start took."""
        self.serving_since = time.monotonic()
        listening, registry = self.broker.listening, self.broker.registry
        took = time.time() - psutil.Process().create_time()
        start = {"event": "start", "address": address, "workers": len(self.supervisor.workers),
                 "models": sorted(registry.models), "versions": len(registry.startup_specs()),
                 "http": listening.http or None, "grpc": listening.grpc or None, "start_s": round(took, 2)}
        log.info("serving on %s%s%s: %d model(s), %d version(s) loaded on %d worker(s), started in %.1f s", address,
                 f", HTTP on {start['http']}" if start["http"] else "",
                 f", gRPC on {start['grpc']}" if start["grpc"] else "", len(start["models"]), start["versions"],
                 start["workers"], took, extra=start)

    def _log_stop(self) -> None:
        """The stop line: why, after how long serving, requests answered and cut short."""
        stats = self.broker.stats
        answered = sum(c.replies + sum(c.errors.values()) for c in stats.models.values())
        served_s = time.monotonic() - (self.serving_since or time.monotonic())
        why = f"on {self.stop_signal}" if self.stop_signal else "when asked"
        log.info("stopped %s after %.1f s serving: %d request(s) answered, %d cut short by the stop", why, served_s,
                 answered, self.cut_short, extra={"event": "stop", "signal": self.stop_signal,
                                                   "served_s": round(served_s, 2), "answered": answered,
                                                   "cut_short": self.cut_short})

    def _enter(self, change: Callable[[], None]) -> None:
        """A phase change, with the load report refreshed at once: a balancer reading /v2/load or the
        header just after /v2/health/ready changed sees the same phase (the periodic look may be late)."""
        change()
        self.load.refresh(time.monotonic(), force=True)
        if self.broker.hub is not None:   # the fronts hear of it as soon
            self.broker.hub.look()

    def shutdown(self) -> None:
        """Refuse new work, tell workers to stop, wait for them, unlink every ring."""
        self.broker.begin_stop()
        for w in self.supervisor.workers:
            self.serving.stop_worker(w)
        self.supervisor.stop()
        if self.serving_since is not None:   # it served: the stop line, once its workers are gone
            self._log_stop()

    async def _wait_ready(self) -> bool:
        """True once every worker is ready; False if asked to stop first; raises on failure."""
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            self.changed.clear()   # nothing sets it before the wait below: one loop thread
            if self.supervisor.all_ready() and (self.fronts is None or self.fronts.all_hello()):
                return True
            failure = self._startup_failure() or (self.fronts.startup_failure() if self.fronts is not None else None)
            if failure is not None:
                raise StartupError(failure)
            if self.stop_event.is_set():
                return False
            left = deadline - time.monotonic()
            if left <= 0:
                raise StartupError(f"workers not ready after {self.start_timeout_s:.0f}s" if not
                                   self.supervisor.all_ready() else
                                   f"front processes not started after {self.start_timeout_s:.0f}s")
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except TimeoutError:
                pass

    def _startup_failure(self) -> str | None:
        if self.broker.handshake.failure:
            return self.broker.handshake.failure
        dead = self.supervisor.first_dead()
        if dead is None:
            return None
        code = dead.proc.returncode   # in last_death already unless a signal or the supervisor ended it
        told = "" if dead.last_death == f"exited with code {code}" else f"exit code {code}; "
        return f"{dead.name} (pid {dead.pid}) {dead.last_death} during start-up ({told}its error is printed above)"

    async def _monitor(self) -> None:
        while True:
            await asyncio.sleep(MONITOR_S)
            self._step()

    def _step(self) -> None:
        try:
            self.watch(time.monotonic())
        except Exception:  # e.g. no room in /dev/shm for a new ring: watching must go on
            log.exception("supervision step failed; trying again on the next look")

    def watch(self, now: float) -> None:
        """One look: deadlines, hung workers (killed), dead workers (restarted once serving),
        due restarts, watchdog."""
        self.broker.tick(now)
        for w, reason in self.hangs.hung(self.broker.roster, now):
            self.supervisor.kill(w, reason)
        faults = self.broker.faults.to_kill
        while faults:   # poisoned: it exits by itself, unless its broken CUDA context hangs it
            w = faults.pop()
            if w.faulted:
                self.supervisor.kill(w, w.faulted)
        serving = self.broker.phase.is_serving()
        if self.supervisor.any_exited():   # its last words first (a fault, a failed load)
            self.broker.back.drain()
        for w in self.supervisor.reap():
            self.serving.remove_worker(w)
            self.changed.set()
            if w.retiring:   # gone for good: off the roster, ring unlinked
                self.supervisor.forget(w)
            elif serving:    # a death during start-up fails the start instead (see _wait_ready)
                self.supervisor.schedule_restart(w)
        if serving:
            self._recycle()
        for w in self.supervisor.due_restarts():
            self._enrol(w)
        if self.fronts is not None:   # dead fronts' requests withdrawn, each started again in its time
            for proc in self.fronts.watch(now, starting=self.broker.phase.now is Phase.STARTING):
                if self.exits is not None:
                    self.exits.add(proc)
            if self.fronts.failure is not None:
                self.changed.set()   # the start fails now, not when the workers are ready
        if self.broker.phase.now is not Phase.STARTING and now - self._last_ping >= WATCHDOG_S:
            self._last_ping = now
            sd_notify("WATCHDOG=1")
        self.load.refresh(now)   # last: a failure here cannot keep the looks above from happening
        if self.broker.hub is not None:
            self.broker.hub.look()   # the fronts' directory: models, pipelines, the load header

    def _recycle(self) -> None:
        """Leaking workers: start a successor; once it serves, route nothing more to the old one;
        once the old one holds nothing, stop it (reap then forgets it). No request fails."""
        while self.broker.memory.to_recycle:
            w = self.broker.memory.to_recycle.pop()
            if w.successor is None and not w.retiring:
                try:
                    self._enrol(self.supervisor.spawn_successor(w))
                except ShmError as exc:  # the leaking worker keeps serving; its snapshot is written
                    log.error("cannot recycle %s: %s", w.name, exc)
        for w in list(self.supervisor.workers):
            if w.successor is not None and w.successor.state is WorkerState.READY:
                w.retire()
            if w.retiring and not w.inflight:
                self.serving.stop_worker(w)

    async def _notice(self) -> None:
        """Not ready for drain_notice_s (health only: requests are taken and served as before),
        so balancers' health checks take this broker out of rotation before it refuses work."""
        if self.notice_s <= 0 or self.skip_event.is_set() or self.force_event.is_set():
            return
        self._enter(self.broker.announce_stop)
        log.info("drain notice: reporting not ready for %g s, still serving; then draining", self.notice_s,
                 extra={"event": "drain_notice", "notice_s": self.notice_s})
        sd_notify(f"STATUS=drain notice: not ready for {self.notice_s:g} s, still serving")
        try:
            await asyncio.wait_for(self.skip_event.wait(), self.notice_s)
        except TimeoutError:
            pass

    async def _drain(self) -> None:
        """Finish queued and in-flight work within the grace (new requests are refused
        meanwhile); whatever is left then, or at a second signal, is answered, not dropped."""
        self._enter(self.broker.begin_stop)
        deadline = time.monotonic() + self.grace_s
        while self.serving.busy() and time.monotonic() < deadline and not self.force_event.is_set():
            await asyncio.sleep(0.01)
        if self.serving.busy():
            why = ("second stop signal" if self.force_event.is_set()
                   else f"shutdown_grace_s ({self.grace_s:g} s) ran out")
            self.cut_short = self.serving.batcher.queued() + sum(
                len(batch.requests) for w in self.broker.roster for batch in w.inflight.values())
            log.warning("stopping with work left: %s", why)
            self.serving.abandon(f"broker stopped before this request ran ({why})")
