"""run_broker: the broker process's one entry function.

Order: title, sockets, rings (sweeping stale ones), signals, then the lifecycle: spawn
workers, wait for their ready handshake, serve until SIGTERM/SIGINT, drain; finally stop
workers, unlink rings, close sockets and remove their files. The parts themselves are built
by assembly.py.
"""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal

import setproctitle
import uvloop
import zmq

from tgw.shm import gc_watch
from tgw.shm.paths import default_address
from tgw.shm.segment import ShmError

from tgw.broker.observe import tracing
from tgw.broker.front.auth import load_token
from tgw.broker.front.callers import fit_max_clients, raise_fd_limit
from tgw.broker.config.load import Config
from tgw.broker.config.startup import StartupError
from tgw.broker.front.endpoints import backend_address, bind, remove_socket_files, zap_handler
from tgw.broker.fleet.hangs import HangJudge
from tgw.broker.fleet.supervisor import Supervisor
from tgw.broker.fronts.fleet import front_count, fronts_socket, run_dir_of
from tgw.broker.models.roles import placement_problems
from tgw.broker.observe.logs import format_in_use

from .assembly import assemble
from .lifecycle import Lifecycle

log = logging.getLogger("tgw.broker")


async def serve(cfg: Config, address: str, config_path: str | None = None) -> None:
    if address.startswith("tcp://") and not cfg.server.curve_secret_key_file:
        raise StartupError("a tcp:// address needs server.curve_secret_key_file (a ZeroMQ CURVE key pair: "
                           "`tgw-broker keygen DIR` writes one)")
    token = load_token(cfg.server.auth_token_file) if cfg.server.auth_token_file else None
    fd_limit = raise_fd_limit()
    base_dir = os.path.dirname(config_path) if config_path else os.getcwd()   # relative paths' root
    obs = cfg.observability   # the workers log and trace as the broker does: told in their WorkerStart
    supervisor = Supervisor(cfg.workers, cfg.supervisor, backend_address(address), log_format=format_in_use(),
                            slow_ms=obs.slow_request_ms, tracing=tracing.for_workers(obs.tracing, base_dir),
                            gc_freeze=cfg.server.gc_freeze)
    misplaced = placement_problems(cfg.models, supervisor.devices, supervisor.roles)
    if misplaced:   # a stage no worker would hold
        raise StartupError("; ".join(misplaced))
    max_clients = fit_max_clients(cfg.server.max_clients, fd_limit, len(supervisor.devices))
    loop = asyncio.get_running_loop()
    ctx = zmq.Context()
    made: list[str] = []  # socket files this start created: removed on every way out
    broker = None
    # front processes serve the HTTP and gRPC faces: none without either
    fronts_count = front_count(cfg.server) if cfg.http is not None or cfg.grpc is not None else 0
    if cfg.server.front_processes and not fronts_count:
        log.warning("server.front_processes %d: no HTTP or gRPC face is configured, so no front process starts "
                    "(they serve those faces' ports)", cfg.server.front_processes)
    run_dir = run_dir_of(supervisor.endpoint) if fronts_count else ""
    try:
        zap = zap_handler(ctx)
        front = bind(ctx, address, cfg.server, public=True)  # refuses first if a live broker has the address
        made.append(address)
        back = bind(ctx, supervisor.endpoint, cfg.server, public=False)
        made.append(supervisor.endpoint)
        hub_sock = fronts_socket(ctx, run_dir) if fronts_count else None   # in a private folder, made now
        broker = assemble(cfg, loop, front, back, zap, token=token, max_clients=max_clients,
                          workers=len(supervisor.devices), roster=supervisor.workers,   # one roster: the supervisor's
                          address=address, config_path=config_path, base_dir=base_dir, fronts=hub_sock,
                          fronts_count=fronts_count, run_dir=run_dir)
        lifecycle = Lifecycle(broker, supervisor, cfg.workers.start_timeout_s, cfg.supervisor.shutdown_grace_s,
                              cfg.server.drain_notice_s, HangJudge(cfg.supervisor, broker.costs,
                                                                   cfg.workers.start_timeout_s))
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lifecycle.on_stop_signal, sig)
        loop.add_signal_handler(signal.SIGUSR1, lifecycle.on_snapshot_signal)
        loop.add_signal_handler(signal.SIGHUP, broker.operator.on_sighup)  # re-read the config, apply the difference
        try:
            fleet = broker.fronts
            if fleet is not None:   # the public ports are the fronts' (held by the broker meanwhile)
                fleet.prepare(cfg.http, cfg.grpc, cfg.server.auth_token_file, f"ipc://{run_dir}/fronts",
                              cfg.workers.output_bytes, format_in_use())
            for name, face in broker.faces.items():
                if fleet is not None and name in fleet.public:   # the broker's own: on its Unix socket
                    await face.start(unix=fleet.unix_path(name))
                    setattr(broker.listening, name, fleet.public[name])
                else:
                    setattr(broker.listening, name, await face.start())
            try:
                swept = supervisor.prepare()
            except ShmError as exc:
                raise StartupError(exc.strerror or str(exc)) from None
            if swept:
                log.warning("swept %d stale segment(s) of dead processes: %s", len(swept), ", ".join(swept))
            await lifecycle.run(address)
        finally:
            lifecycle.shutdown()
            broker.serving.abandon("the broker stopped before this request ran")  # nothing admitted goes unanswered
            if broker.fronts is not None:   # after the answers, so the fronts can write them; before
                await broker.fronts.stop()  # the broker's faces, which they forward to
            for face in broker.faces.values():   # after the answers, so their handlers can write them
                await face.stop()
            broker.close()
    finally:
        ctx.destroy(linger=0)
        remove_socket_files(*made)
        if run_dir:   # the fronts' socket, the faces' Unix sockets, the fronts' config file
            shutil.rmtree(run_dir, ignore_errors=True)
        if broker is not None and broker.tracer is not None:
            broker.tracer.shutdown()   # the last spans written (or sent)


def run_broker(cfg: Config, address: str | None = None, config_path: str | None = None) -> int:
    """`config_path`: the file `cfg` came from, re-read on SIGHUP (None: the embedded demo)."""
    setproctitle.setproctitle("tgw-broker")  # what ps and top show
    gc_watch.watch.install()   # every collection timed from the start (status `gc`)
    try:
        uvloop.run(serve(cfg, address or cfg.server.address or default_address(), config_path))
    except StartupError as exc:
        log.error("start-up failed: %s", str(exc).replace("\n", "; "), extra={"event": "start_failed", "error": str(exc)})
        return 1
    return 0
