"""The broker's serving core: client requests in, batches to workers, replies out.

Everything here runs as plain callbacks on one uvloop loop: decode once, validate, queue,
and let one pump per loop turn form batches for idle workers (so a burst drained from the
socket becomes one batch, not many).
"""
from __future__ import annotations

import asyncio
import logging
import os
import time

import lz4.frame
import zmq

from tgw.shm.errors import ERROR_TABLE, Code, TgwError, fail
from tgw.shm.ring import aligned_total
from tgw.shm.wire import PROTOCOL_VERSION, DecodeError, Done, ErrorBody, ErrorReply, Health, HealthReply, Hello, \
    HelloReply, Infer, InferReply, ListModels, ModelsReply, Release, Stats, StatsReply, TensorMeta, WorkerFailed, \
    WorkerHello, WorkerReady, LoadModels, Stop, encode, envelope_decoder, from_worker_decoder, nbytes_of, \
    request_decoder

from .batcher import Batcher, Pending
from .config import Config
from .pool import WorkerHandle
from .registry import Registry
from .sockets import Pump
from .stats import Stats as Counters
from .supervisor import Supervisor

log = logging.getLogger("tgw.broker")
SERVER_NAME = "tgw/0.1.0"


class Broker:
    def __init__(self, cfg: Config, supervisor: Supervisor):
        self.cfg, self.supervisor = cfg, supervisor
        self.registry = Registry(cfg)
        self.batcher = Batcher()
        self.stats = Counters()
        for m in cfg.models:
            self.batcher.add_model(m.name, m.max_batch_size, m.max_queue)
            self.stats.model(m.name)
        self.max_request = cfg.server.max_request_bytes
        self.max_inflight = cfg.server.max_inflight_batches_per_worker
        self.by_identity: dict[bytes, WorkerHandle] = {}
        self.batch_seq = 0
        self.stopping = False
        self._pump_scheduled = False
        self.startup_failure: str | None = None
        self.started = False  # every worker answered its first ready handshake

    def attach(self, loop: asyncio.AbstractEventLoop, front: zmq.Socket, back: zmq.Socket) -> None:
        self.loop = loop
        self.front = Pump(loop, front, self.on_client)
        self.back = Pump(loop, back, self.on_worker)

    # ---- client side -------------------------------------------------------------------------

    def on_client(self, frames: list) -> None:
        ident = frames[0].bytes
        if len(frames) < 2:
            return self._error(ident, 0, fail(Code.INVALID_ARGUMENT, "empty message: a header frame is required"))
        try:
            msg = request_decoder.decode(frames[1].buffer)
        except DecodeError as exc:
            return self._malformed(ident, frames[1].buffer, exc)
        if msg.v != PROTOCOL_VERSION:
            return self._version_mismatch(ident, msg.id, msg.v)
        if isinstance(msg, Infer):
            try:
                self._admit(ident, msg, frames[2:])
            except TgwError as err:
                self._error(ident, msg.id, err, msg.model)
            except Exception as exc:  # a broker bug must still answer, and must not stop the drain
                log.exception("request %d for %r failed inside the broker", msg.id, msg.model)
                self._error(ident, msg.id, fail(Code.INTERNAL, f"broker error: {type(exc).__name__}: {exc}"),
                            msg.model)
        elif isinstance(msg, Hello):
            self._reply(ident, HelloReply(v=PROTOCOL_VERSION, id=msg.id, server=SERVER_NAME,
                                          max_request_bytes=self.max_request))
        elif isinstance(msg, ListModels):
            self._reply(ident, ModelsReply(v=PROTOCOL_VERSION, id=msg.id,
                                           models=[m.info(self._serving(m.name, m.decl.default))
                                                   for m in self.registry.models.values()]))
        elif isinstance(msg, Health):
            self._reply(ident, self.health(msg.id))
        elif isinstance(msg, Stats):
            self._reply(ident, StatsReply(v=PROTOCOL_VERSION, id=msg.id, models={
                n: c.as_dict() for n, c in self.stats.models.items()}, processes=self.processes(),
                errors=dict(self.stats.unrouted_errors)))

    def _malformed(self, ident: bytes, header, exc: Exception) -> None:
        try:
            env = envelope_decoder.decode(header)
        except DecodeError:
            env = None
        # `type(...) is int`: a bool is an int to isinstance, but not on the wire
        req_id = env.id if env is not None and type(env.id) is int else 0
        if env is not None and type(env.v) is int and env.v != PROTOCOL_VERSION:
            # a newer client's header may not fit our structs: name the real problem
            return self._version_mismatch(ident, req_id, env.v)
        self._error(ident, req_id, fail(Code.INVALID_ARGUMENT, f"malformed request header: {exc}"))

    def _version_mismatch(self, ident: bytes, req_id: int, version: int) -> None:
        self._error(ident, req_id, fail(
            Code.INVALID_ARGUMENT, f"protocol version mismatch: client speaks {version}, broker speaks "
            f"{PROTOCOL_VERSION}", client_protocol=version, server_protocol=PROTOCOL_VERSION))

    def _admit(self, ident: bytes, msg: Infer, tensor_frames: list) -> None:
        if self.stopping:
            raise fail(Code.MODEL_NOT_READY, "broker is shutting down")
        sizes = [len(f) for f in tensor_frames]
        if sum(sizes) > self.max_request:
            raise fail(Code.PAYLOAD_TOO_LARGE, f"request carries {sum(sizes)} bytes of tensors; the limit is "
                       f"{self.max_request} (server.max_request_bytes)", limit=self.max_request)
        checked = self.registry.validate(msg, sizes)
        tensors = [self._tensor_bytes(msg.inputs[i], tensor_frames[i].buffer) for i in checked.order]
        arena = self.supervisor.workers[0].input_bytes
        need = aligned_total([len(t) for t in tensors])  # what staging it alone would take
        if need > arena:
            raise fail(Code.PAYLOAD_TOO_LARGE, f"request needs {need} bytes of shared memory; a worker's input "
                       f"arena holds {arena} (workers.input_arena_mb)", limit=arena)
        model = checked.model.decl
        now = time.monotonic()
        timeout_ms = msg.timeout_ms if msg.timeout_ms is not None else model.timeout_ms
        p = Pending(client=ident, req_id=msg.id, model=model.name, version=checked.version, rows=checked.rows,
                    shape_key=checked.shape_key, tensors=tensors, outputs=checked.outputs,
                    deadline=now + timeout_ms / 1000.0, compress=msg.compress_outputs)
        self.batcher.push(p)
        self.stats.models[model.name].requests += 1
        self.schedule()

    @staticmethod
    def _tensor_bytes(meta: TensorMeta, buf: memoryview):
        if meta.compression is None:
            return buf
        want = nbytes_of(meta.dtype, meta.shape)
        inflate = lz4.frame.LZ4FrameDecompressor()
        try:  # never inflate past the declared size: a small frame must not cost gigabytes
            raw = inflate.decompress(buf, max_length=want)
        except RuntimeError as exc:
            raise fail(Code.INVALID_ARGUMENT, f"input {meta.name!r}: bad lz4 frame: {exc}") from None
        if len(raw) != want or not inflate.eof:
            raise fail(Code.INVALID_ARGUMENT, f"input {meta.name!r}: lz4 frame does not decompress to the "
                       f"{want} bytes that shape {meta.shape} x {meta.dtype} needs", input=meta.name)
        return memoryview(raw)

    def _reply(self, ident: bytes, msg, *tensors) -> None:
        self.front.send([ident, encode(msg), *tensors])

    def _error(self, ident: bytes, req_id: int, err: TgwError, model: str | None = None) -> None:
        self.stats.error(model, err.code.value)
        body = ErrorBody(code=err.code.value, message=err.message, retryable=ERROR_TABLE[err.code][1],
                         details=err.details)
        self._reply(ident, ErrorReply(v=PROTOCOL_VERSION, id=req_id, error=body))

    def _fail_pending(self, p: Pending, code: Code, message: str) -> None:
        self._error(p.client, p.req_id, fail(code, message, model=p.model), p.model)

    def health(self, req_id: int = 0) -> HealthReply:
        models = {m.name: self._serving(m.name, m.decl.default) for m in self.registry.models.values()}
        workers = {w.name: w.state for w in self.supervisor.workers}
        ready = self.started and not self.stopping and all(models.values())
        return HealthReply(v=PROTOCOL_VERSION, id=req_id, live=True, ready=ready, models=models, workers=workers)

    def _serving(self, model: str, version: str) -> bool:
        """A live, ready worker has this version loaded now."""
        key = f"{model}:{version}"
        return any(w.state == "ready" and key in w.models for w in self.supervisor.workers)

    def processes(self) -> list[dict]:
        return [{"role": "broker", "pid": os.getpid(), "device": ""}] + [
            {"role": "worker", "pid": w.pid, "device": w.device, "state": w.state} for w in self.supervisor.workers]

    # ---- scheduling --------------------------------------------------------------------------

    def schedule(self) -> None:
        if not self._pump_scheduled:
            self._pump_scheduled = True
            self.loop.call_soon(self.pump)

    def pump(self) -> None:
        """Hand batches to workers with room, round-robin over models, until nothing moves."""
        self._pump_scheduled = False
        full: set[int] = set()
        moved = True
        while moved:
            moved = False
            for model in self.batcher.models_with_work():
                head = self.batcher.queues[model].items[0]
                worker = self._pick(f"{model}:{head.version}", full)
                if worker is None:
                    continue
                if self._dispatch(model, worker):
                    moved = True
                else:
                    full.add(worker.worker_id)
        for w in self.supervisor.workers:
            # releases ride on the next batch; a busy worker with none coming may need the space
            if w.releases and w.inflight:
                self.back.send([w.identity, encode(Release(blocks=w.take_releases()))])

    def _pick(self, key: str, full: set[int]) -> WorkerHandle | None:
        best = None
        for w in self.supervisor.workers:
            if w.worker_id not in full and w.can_take(key, self.max_inflight):
                if best is None or len(w.inflight) < len(best.inflight):
                    best = w
        return best

    def _dispatch(self, model: str, worker: WorkerHandle) -> bool:
        now = time.monotonic()
        batch = self.batcher.next_batch(model, worker.input_bytes)
        live = []
        for p in batch:
            if p.deadline <= now:
                self._fail_pending(p, Code.DEADLINE_EXCEEDED, "deadline passed while queued")
            else:
                live.append(p)
        if not live:
            return True
        self.batch_seq += 1
        msg = worker.stage(self.batch_seq, live, self.registry.models[model].inputs)
        if msg is None:  # input arena full until a completion frees a block
            for p in reversed(live):
                self.batcher.push(p, front=True)
            return False
        self.back.send([worker.identity, encode(msg)])
        return True

    def sweep_deadlines(self) -> None:
        for p in self.batcher.expired():
            self._fail_pending(p, Code.DEADLINE_EXCEEDED, "deadline passed while queued")

    # ---- worker side -------------------------------------------------------------------------

    def on_worker(self, frames: list) -> None:
        ident = frames[0].bytes
        try:
            msg = from_worker_decoder.decode(frames[1].buffer)
        except (DecodeError, IndexError) as exc:
            log.error("undecodable message from worker %r: %s", ident, exc)
            return
        worker = self.by_identity.get(ident)
        if worker is None:
            log.warning("message from unknown or replaced worker %r ignored", ident)
            return
        if isinstance(msg, Done):
            self._complete(worker, msg)
        elif isinstance(msg, WorkerHello):
            worker.pid = msg.pid
            self.back.send([ident, encode(LoadModels(models=self.registry.specs()))])
        elif isinstance(msg, WorkerReady):
            self.supervisor.ready(worker, msg.models)
            for key in msg.models:
                name, version = key.split(":", 1)
                self.registry.models[name].ready_versions.add(version)
            log.info("%s ready with %s", worker.name, ", ".join(msg.models))
            self.schedule()
        elif isinstance(msg, WorkerFailed):
            self.startup_failure = f"{worker.name} failed to load model {msg.model}: {msg.error}"
            log.error("%s", self.startup_failure)

    def _complete(self, worker: WorkerHandle, done: Done) -> None:
        batch = worker.finish(done)
        if batch is None:
            log.warning("completion for unknown batch %d from %s", done.batch_id, worker.name)
            return
        if done.error is not None:
            for p in batch.requests:
                self._fail_pending(p, Code(done.error.code), done.error.message)
        else:
            self.stats.batch(batch.model, batch.rows, done.compute_us)
            counters = self.stats.models[batch.model]
            for p, views in worker.output_rows(done, batch):
                metas, payload = [], []
                for name in p.outputs:
                    t, view = views[name]
                    data = lz4.frame.compress(view) if p.compress else view
                    metas.append(TensorMeta(name=name, dtype=t.dtype, shape=[p.rows, *t.shape[1:]],
                                            compression="lz4" if p.compress else None))
                    payload.append(data)
                self._reply(p.client, InferReply(v=PROTOCOL_VERSION, id=p.req_id, model=p.model,
                                                 version=p.version, outputs=metas), *payload)
                counters.replies += 1
            worker.releases.append(done.block)
        self.schedule()

    def worker_lost(self, worker: WorkerHandle) -> None:
        """Retry a dead worker's in-flight requests once elsewhere; answer the rest WORKER_DIED."""
        self.by_identity.pop(worker.identity, None)
        for batch in worker.inflight.values():
            for p in reversed(batch.requests):
                if p.attempts == 0 and not self.stopping:
                    p.attempts += 1
                    self.batcher.push(p, front=True)
                else:
                    self._fail_pending(p, Code.WORKER_DIED, f"{worker.name} died while running this request")
        worker.inflight.clear()
        self.schedule()

    def busy(self) -> bool:
        return self.batcher.queued() > 0 or any(w.inflight for w in self.supervisor.workers)

    def stop_workers(self) -> None:
        for w in self.supervisor.workers:
            if w.state != "dead":
                w.state = "stopping"
                self.back.send([w.identity, encode(Stop())])
