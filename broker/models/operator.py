"""The operator's control ops on the native socket, and SIGHUP: one at a time, each answered.

load, unload, traffic and reload change what is served; they are refused on a tcp://
listener unless server.auth_token_file is configured (on a Unix socket the socket's file
permissions are the authentication). metadata only reads. An op runs as a task on the event
loop, so serving goes on while it waits for loads and drains; a second op waits its turn.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable

from tgw.shm.errors import Code, TgwError, fail
from tgw.shm.wire import PROTOCOL_VERSION, ControlReply, ErrorReply, LoadVersion, Metadata, Reload, \
    SetTraffic, UnloadVersion

from tgw.broker.config.load import Config, ServerDecl
from .adopt import Adoption
from .guarded import Decision
from .reload import ReloadDeps, Reloader
from .rollout import Rollout, RolloutDeps

log = logging.getLogger("tgw.broker")


def unauthenticated(address: str, server: ServerDecl) -> bool:
    """Control ops are refused here: a tcp:// listener (CURVE encrypts, but any key pair may
    connect) without the shared token."""
    return address.startswith("tcp://") and not server.auth_token_file


@dataclass(frozen=True)
class OperatorDeps:
    """What the operator reads and calls (filled in by broker/core/assembly.py)."""
    rollout: RolloutDeps
    reload: ReloadDeps
    reply: Callable[[bytes, object], None]   # the front door's answer to a client
    serving: Callable[[], bool]              # control ops wait until the broker serves ...
    phase: Callable[[], str]                 # ... and say what it does instead ("starting", "stopping")


class Operator:
    def __init__(self, d: OperatorDeps, cfg: Config, address: str, config_path: str | None = None,
                 reload_outcome: dict | None = None):
        """`cfg`: the served config, which a reload compares with the file's; `reload_outcome`:
        where the last reload's outcome is kept (status reads it)."""
        self.d = d
        self.rollout = Rollout(d.rollout, cfg.model_roots, cfg.workers.start_timeout_s,
                               cfg.supervisor.shutdown_grace_s)
        outcome = {} if reload_outcome is None else reload_outcome
        self.reloader = Reloader(d.reload, self.rollout, cfg, config_path, outcome)
        self.adoption = Adoption(self.rollout, self.reloader)
        self.unauthenticated = unauthenticated(address, cfg.server)
        self.lock = asyncio.Lock()
        self.tasks: set[asyncio.Task] = set()   # held so they are not collected while they run

    def handle(self, ident: bytes, msg) -> None:
        """A control op or metadata request from a client (the front door decoded it)."""
        try:
            if isinstance(msg, Metadata):
                return self.d.reply(ident, self.rollout.metadata(msg))
            if not self.d.serving():   # loads need live workers; a stop must not wait for a load
                raise fail(Code.MODEL_NOT_READY, f"the broker is {self.d.phase()}: control ops wait until "
                           "it serves", reason=self.d.phase())
            if self.unauthenticated:
                raise fail(Code.UNAUTHENTICATED, "control ops are refused on a tcp:// listener unless "
                           "server.auth_token_file is configured; use the Unix socket, or configure a token",
                           op=type(msg).__name__)
        except TgwError as err:
            return self.answer_error(ident, msg.id, err)
        self.spawn(self.run(ident, msg))

    def on_sighup(self) -> None:
        if not self.d.serving():
            log.warning("SIGHUP ignored: the broker is %s (send it again once it serves)", self.d.phase())
            return
        log.info("SIGHUP: reloading %s", self.reloader.path or "(no config file)")
        self.spawn(self.run(None, Reload(v=PROTOCOL_VERSION)))

    def decide(self, decision: str, model: str, version: str, why: str, figures: dict) -> None:
        """A guard's verdict (canary/guards.py): carried out as an op, in turn with the others."""
        self.spawn(self.run(None, Decision(decision, model, version, why, figures)))

    def spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def run(self, ident: bytes | None, msg) -> None:
        async with self.lock:
            try:
                reply = await self.do(msg)
            except TgwError as err:
                log.warning("%s refused: %s", type(msg).__name__, err.message.replace("\n", "; "))   # one line
                if ident is not None:
                    self.answer_error(ident, msg.id, err)
            except Exception as exc:  # a broker bug: answered, logged, and the next op still runs
                log.exception("%s failed inside the broker", type(msg).__name__)
                if ident is not None:
                    self.answer_error(ident, msg.id, fail(Code.INTERNAL, f"broker error: {type(exc).__name__}: {exc}"))
            else:
                log.info("%s: %s", type(msg).__name__, reply.message)
                if ident is not None:
                    self.d.reply(ident, reply)

    async def do(self, msg) -> ControlReply:
        if isinstance(msg, LoadVersion):
            return await self.rollout.load(msg)
        if isinstance(msg, UnloadVersion):
            return await self.rollout.unload(msg)
        if isinstance(msg, SetTraffic):
            return self.rollout.traffic(msg)
        if isinstance(msg, Reload):
            return await self.reloader.reload(msg)
        if isinstance(msg, Decision):
            return await self.rollout.decide(msg)
        raise fail(Code.INVALID_ARGUMENT, f"not a control op: {type(msg).__name__}")

    async def exclusive(self, op):
        """`op()` (a coroutine function: TorchServe's register, unregister, set default through
        self.adoption) run in turn with the other ops; its answer or its error."""
        if not self.d.serving():
            raise fail(Code.MODEL_NOT_READY, f"the broker is {self.d.phase()}: control ops wait until "
                       "it serves", reason=self.d.phase())
        async with self.lock:
            return await op()

    def answer_error(self, ident: bytes, req_id: int, err: TgwError) -> None:
        # not counted as a request error: control ops are not inference
        self.d.reply(ident, ErrorReply(v=PROTOCOL_VERSION, id=req_id, error=err.to_body()))
