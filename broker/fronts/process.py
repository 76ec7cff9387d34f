"""One front process's life: `python -m tgw.broker.fronts --run-dir D --index I --config-json F`.

The hub's fleet starts it (broker/fronts/fleet.py) with F, a JSON object:
  {"config": <the Config, cfg.model_dump(mode="json")>,
   "hub": "ipc://<D>/fronts",                                  # optional: this by default
   "http": {"host": str, "port": int, "broker": "<D>/http.sock"} or null,   # the public address
   "grpc": {"host": str, "port": int, "broker": "<D>/grpc.sock"} or null,   # and the broker's face
   "token_file": path or null,    # server.auth_token_file made absolute (else the config's)
   "broker_pid": int,             # optional: the parent to watch (else this process's parent)
   "max_reply_bytes": int,        # optional: the workers' output arena (the gRPC send limit)
   "log_format": "text" | "json"}                              # optional
A face missing from F is not served here. In order: the gc watch installed; the DEALER to the
hub connected; the listeners opened on the public ports (SO_REUSEPORT); HELLO sent (so a front
the hub counts is one that listens, and a port it cannot take fails the start); the first
DIRECTORY awaited; its input region registered (region.py); then, with server.gc_freeze,
everything made so far frozen out of the collector. About once a second STATS goes to the hub; the parent is looked at twice a second.

How it ends: DRAIN from the hub or SIGTERM: the listeners close, what is open is answered,
exit 0. The broker gone (the fronts socket closed or its heartbeat timed out, or this process
re-parented): exit 1 at once, as nothing it holds can be answered any more. SIGINT is ignored
(a terminal's Ctrl-C reaches the whole group; the broker drains its fronts itself).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from typing import Any

import msgspec
import zmq

from tgw.shm.gc_watch import watch
from tgw.shm.wire import ErrorReply, RegionReply

from tgw.broker.config.load import Config
from tgw.broker.config.startup import StartupError
from tgw.broker.front.auth import load_token

from . import wire
from .link import Link, endpoint
from .mirror import Mirror
from .region import REGION_BYTES, FrontRegion
from .remote_port import RemotePort

log = logging.getLogger("tgw.broker")
STATS_S = 1.0            # STATS to the hub this often
PARENT_S = 0.5           # the parent looked at this often
FIRST_DIRECTORY_S = 60.0   # no directory from the hub in this long: the broker is not there
DRAIN_POLL_S = 0.05      # while draining, how often "is everything answered?" is asked
REGION_WAIT_S = 10.0     # the broker's answer to the region's registration awaited this long
REPLY_BYTES = 1 << 30    # the gRPC send limit when F names none (the broker's own limits bound replies)


class Front:
    def __init__(self, cfg: Config, spec: dict[str, Any], run_dir: str, index: int):
        self.cfg, self.spec, self.run_dir, self.index = cfg, spec, run_dir, index
        self.parent = spec.get("broker_pid") or os.getppid()
        self.watch = watch   # this process's (shm/gc_watch.py)
        self.stopping: asyncio.Future | None = None
        self.listeners: list = []
        self.port: RemotePort | None = None

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self.watch.install()
        self.stopping = loop.create_future()
        token_file = self.spec.get("token_file") or self.cfg.server.auth_token_file
        token = load_token(token_file) if token_file else None
        ctx = zmq.Context()
        link = None
        try:
            mirror = Mirror(lambda: link.send([wire.DIRECTORY]))
            link = Link(loop, ctx, self.spec.get("hub") or endpoint(self.run_dir), self.index,
                        {wire.DIRECTORY: lambda f: self.on_directory(mirror, f),
                         wire.REPLY: lambda f: self.port.on_reply(f),
                         wire.DRAIN: lambda f: self.stop("the hub said DRAIN")}, self.lost)
            self.port = port = RemotePort(link.send, mirror, token)
            self.look_at_parent()
            loop.add_signal_handler(signal.SIGTERM, self.stop, "SIGTERM")
            loop.add_signal_handler(signal.SIGINT, lambda: None)
            # listening before HELLO: a front the hub counts serves (a request before the first
            # directory waits for it: the mirror asks); a port it cannot take fails the start
            self.listeners = self.make_listeners(port, mirror)
            for listener in self.listeners:
                await listener.start()
            link.send([wire.HELLO, wire.encoder.encode(wire.FrontHello(index=self.index, pid=os.getpid()))])
            done, _ = await asyncio.wait([mirror.first, self.stopping], timeout=FIRST_DIRECTORY_S,
                                         return_when=asyncio.FIRST_COMPLETED)
            if not done:
                raise StartupError(f"front {self.index}: no directory from the hub at {link.identity} "
                                   f"within {FIRST_DIRECTORY_S:.0f} s")
            await self.open_region(port)
            if self.cfg.server.gc_freeze:   # what start-up made stays out of every collection
                self.watch.freeze()
            else:   # the longest pause counts from serving on, as the freeze makes it count
                self.watch.reset_longest()
            self.tick(link)
            log.info("front %d (pid %d) serving %s", self.index, os.getpid(),
                     ", ".join(f"{f} on {self.spec[f]['host']}:{self.spec[f]['port']}" for f in ("http", "grpc")
                               if self.spec.get(f)))
            await self.stopping
            await self.drain()
            return 0
        finally:
            for listener in self.listeners:
                await listener.stop()
            if link is not None:
                link.close()
            ctx.destroy(linger=0)
            if self.port is not None and self.port.region is not None:
                self.port.region.close()   # the broker sweeps its mapping once this process is gone

    async def open_region(self, port: RemotePort) -> None:
        """Register this life's input region (region.py) and wait for the broker's answer; with
        none (server.max_region_bytes 0, a refusal, no answer in REGION_WAIT_S) every tensor
        travels as a frame: a front serves without it."""
        nbytes = min(REGION_BYTES, self.cfg.server.max_region_bytes)
        if nbytes <= 0:
            return
        region = FrontRegion(nbytes)
        answer = asyncio.get_running_loop().create_future()
        caller = _Answer(answer)
        port.dispatch(caller, region.register_request())
        try:
            reply = await asyncio.wait_for(answer, REGION_WAIT_S)
        except asyncio.TimeoutError:
            reply = None
            port.withdraw(caller, "front_region")   # not left in flight (a drain waits for those)
        if type(reply) is RegionReply:
            region.handle = reply.region
            port.region = region
        else:
            region.close()
            why = reply.error.message if type(reply) is ErrorReply else f"no answer within {REGION_WAIT_S:.0f} s"
            log.warning("front %d: no input region (%s): tensors travel as frames", self.index, why)

    def make_listeners(self, port: RemotePort, mirror: Mirror) -> list:
        out = []
        http, grpc = self.spec.get("http"), self.spec.get("grpc")
        if http and self.cfg.http is not None:
            from .http_local import HttpLocal
            out.append(HttpLocal(port, mirror, self.cfg.http, http["host"], http["port"], http["broker"]))
        if grpc and self.cfg.grpc is not None:
            from .grpc_local import GrpcLocal
            out.append(GrpcLocal(port, mirror, self.cfg.grpc, self.cfg.server.max_request_bytes,
                                 self.spec.get("max_reply_bytes", REPLY_BYTES), grpc["host"], grpc["port"],
                                 grpc["broker"]))
        return out

    def on_directory(self, mirror: Mirror, frames: list) -> None:
        d = wire_directory.decode(frames[1].buffer)
        mirror.apply(d)
        load = self.port.load
        load.header = d.load_header or ""
        load.draining = d.draining or self.stopping.done()   # the broker's drain notice, or this front's drain

    def stop(self, why: str) -> None:
        if self.stopping is not None and not self.stopping.done():
            log.info("front %d: draining (%s)", self.index, why)
            self.port.load.draining = True
            self.stopping.set_result(why)

    async def drain(self) -> None:
        """Listeners closed; every request handed to the broker answered (the broker answers
        each one it admitted, also while it drains)."""
        for listener in self.listeners:
            await listener.stop_listening()
        while self.port.inflight or any(listener.busy() for listener in self.listeners):
            await asyncio.sleep(DRAIN_POLL_S)

    def lost(self, why: str) -> None:
        log.error("front %d: the broker is gone (%s): exiting", self.index, why)
        logging.shutdown()
        os._exit(1)

    def look_at_parent(self) -> None:
        """Re-parented: the broker died (also before the fronts socket ever connected)."""
        if os.getppid() != self.parent:
            self.lost(f"the parent process {self.parent} exited")
        asyncio.get_running_loop().call_later(PARENT_S, self.look_at_parent)

    def tick(self, link: Link) -> None:
        """STATS to the hub."""
        port = self.port
        requests = sum(listener.requests for listener in self.listeners)
        forwarded = sum(listener.forwarded_count() for listener in self.listeners)
        stats = wire.FrontStats(inflight=port.inflight, requests=requests, forwarded=forwarded,
                                gc=self.watch.as_dict(),
                                region=port.region.as_dict() if port.region is not None else {})
        link.send([wire.STATS, wire.encoder.encode(stats)])
        asyncio.get_running_loop().call_later(STATS_S, self.tick, link)


wire_directory = msgspec.msgpack.Decoder(wire.Directory)


class _Answer:
    """The caller of the front's own region request: the reply settles a future."""
    __slots__ = ("future",)

    def __init__(self, future: asyncio.Future):
        self.future = future

    def deliver(self, msg, frames) -> None:
        if not self.future.done():
            self.future.set_result(msg)


def read_spec(path: str) -> tuple[Config, dict]:
    """F's Config (validated as the broker validated it) and the rest of F."""
    try:
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
    except (OSError, ValueError) as exc:
        raise StartupError(f"front: cannot read {path}: {exc}") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("config"), dict):
        raise StartupError(f"front: {path} holds no \"config\" object")
    try:
        cfg = Config.model_validate(spec["config"])
    except ValueError as exc:
        raise StartupError(f"front: the config in {path} does not validate: {exc}") from None
    for face in ("http", "grpc"):
        got = spec.get(face)
        if got is not None and not (isinstance(got, dict) and isinstance(got.get("host"), str)
                                    and type(got.get("port")) is int and isinstance(got.get("broker"), str)):
            raise StartupError(f"front: {path}: {face!r} must be {{\"host\": str, \"port\": int, \"broker\": str}}")
    return cfg, spec
