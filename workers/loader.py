"""The worker's loader: a thread that loads and unloads models while the serving loop runs batches.

It owns its own DEALER (identity: the worker's + b"~load") on the worker's zmq Context, as the
beacon does, and shares the serving loop's `runners` dict. A runner enters the dict before its
ModelLoaded is sent, so the broker never routes a batch to a model that is not there yet; the
broker sends UnloadModel only once no batch of that model is in flight here.

It loads the start-up models too (the broker's LoadModels, handed over by the main thread),
one by one while the serving loop already runs: each serves as soon as it is warmed up, so a
slow model does not hold up a fast one. Every load tells its phases as it moves (LoadPhase:
loading, warming), which the broker shows in `status` and on a terminal.
"""
from __future__ import annotations

import gc
import logging
import time
import weakref

import torch
import zmq

from tgw.shm import gc_watch
from tgw.shm.model_format import ModelFormatError
from tgw.shm.wire import DecodeError, LoaderHello, LoadModel, LoadPhase, ModelLoaded, ModelSpec, ModelUnloaded, \
    ReplayReport, UnloadModel, WorkerFailed, WorkerReady, encode, model_key, to_worker_decoder

from .footprint import Gauge, rss_bytes, trim_heap, warm_measured
from .formats import FormatMismatch
from .generate.runner import GeneratorRunner
from .load_errors import error_text, log_traceback
from .replay import warm_replay
from .runner import ChecksumMismatch, ModelRunner
from .sequence_runner import SequenceFileRunner, SequenceStageRunner
from .sidethread import SideThread
from .stage_runner import StageRunner

log = logging.getLogger("tgw.worker")
LOAD_SUFFIX = b"~load"


class LoadFailed(Exception):
    def __init__(self, reason: str, exc: BaseException):
        super().__init__(error_text(exc))
        self.reason = reason


class Loader(SideThread):
    def __init__(self, ctx: zmq.Context, endpoint: str, identity: bytes, worker_id: int,
                 runners: dict[str, ModelRunner], device: torch.device):
        super().__init__(ctx, endpoint, identity + LOAD_SUFFIX, "tgw-loader")
        self.worker_id, self.runners, self.device = worker_id, runners, device
        # the broker's messages to the loader, each type to the handler that makes its reply
        self.handlers = {LoadModel: lambda msg: self.load(msg.spec), UnloadModel: lambda msg: self.unload(msg.key)}
        self.startup: list[ModelSpec] | None = None   # the start-up models, once the main thread hands them over
        self.freeze = False   # gc.freeze() once they are in and warm (WorkerStart.gc_freeze)
        self.startup_failed = False   # written once by the thread, before its WorkerFailed: the exit status's

    def start(self, startup: list[ModelSpec] | None = None, freeze: bool = False) -> None:
        """Start the thread; with `startup` (the broker's LoadModels), it loads those first, then
        with `freeze` (server.gc_freeze) freezes the heap (shm/gc_watch.py) before WorkerReady."""
        self.startup, self.freeze = startup, freeze
        super().start()

    def _run(self) -> None:
        poller = self.poller()
        try:
            if self.device.type == "cuda":  # the current device is per thread
                torch.cuda.set_device(self.device)
            self.sock.send(encode(LoaderHello(worker_id=self.worker_id)))
            if self.startup is not None:
                self.sock.send(encode(self.start_up(self.startup)))
            while self.serve_once(poller):
                pass
        finally:
            self._close()

    def start_up(self, specs: list[ModelSpec]) -> WorkerReady | WorkerFailed:
        """Load the start-up models in order, each published and told (ModelLoaded, `startup`) as
        soon as it is warmed up; then WorkerReady naming them all. The first that fails ends it:
        WorkerFailed, and the broker stops this worker (those already in served meanwhile)."""
        loaded: dict[str, ModelRunner] = {}
        for spec in specs:
            key = model_key(spec.name, spec.version)
            reply = self._load(spec, key)
            if reply.error is not None:   # the broker logs it: the worker does not say it twice
                self.startup_failed = True
                release_memory(self.device)
                return WorkerFailed(worker_id=self.worker_id, model=key, error=reply.error)
            reply.startup = True
            loaded[key] = self.runners[key]
            self.sock.send(encode(reply))
        if self.freeze:   # torch, the models and their warm-up are start-up objects: no collection walks them again
            gc_watch.watch.freeze()
        else:
            gc_watch.watch.reset_longest()   # the longest pause: one met while serving, as with the freeze
        return WorkerReady(worker_id=self.worker_id, models=sorted(loaded),
                           sizes={key: runner.nbytes for key, runner in loaded.items()},
                           footprints={key: runner.footprint for key, runner in loaded.items()})

    def _answer(self) -> None:
        try:
            msg = to_worker_decoder.decode(self.sock.recv())
        except DecodeError as exc:  # a bad message must not end the loader
            log.warning("undecodable loader message ignored: %s", exc)
            return
        handler = self.handlers.get(type(msg))
        if handler is None:
            log.warning("loader socket got %s: ignored", type(msg).__name__)
            return
        self.sock.send(encode(handler(msg)))

    def load(self, spec: ModelSpec) -> ModelLoaded:
        """Load, warm up and publish one model; a repeated load answers at once."""
        key = model_key(spec.name, spec.version)
        loaded = self.runners.get(key)
        if loaded is not None:
            rss = rss_bytes()
            return ModelLoaded(worker_id=self.worker_id, key=key, bytes=loaded.nbytes, rss_before=rss, rss_after=rss,
                               footprint=loaded.footprint, slots=getattr(loaded, "slots", 0))
        reply = self._load(spec, key)
        if reply.error is not None:   # its traceback was logged once, where it failed (log_traceback)
            release_memory(self.device)  # the half-built model's cycles (its traceback) hold it
            reply.rss_after = rss_bytes()
        return reply

    def _load(self, spec: ModelSpec, key: str) -> ModelLoaded:
        """Build, warm up and publish one model, telling its phases; the answer, a failure's too."""
        rss_before, t0 = rss_bytes(), time.perf_counter()
        try:
            runner, replayed, warm_s = self._build(spec, key, t0)
        except LoadFailed as failed:
            reply = ModelLoaded(worker_id=self.worker_id, key=key, error=str(failed), reason=failed.reason)
            log_traceback(key, reply.error, failed.__context__, failed.reason)   # raised from the load's exception
        else:
            self.runners[key] = runner  # before the reply: once the broker reads it, batches come
            reply = ModelLoaded(worker_id=self.worker_id, key=key, bytes=runner.nbytes,
                                load_ms=(time.perf_counter() - t0) * 1000, warm_ms=warm_s * 1000,
                                footprint=runner.footprint, replay=replayed, slots=getattr(runner, "slots", 0))
        reply.rss_before, reply.rss_after = rss_before, rss_bytes()
        return reply

    def _build(self, spec: ModelSpec, key: str, t0: float) -> tuple[ModelRunner, ReplayReport | None, float]:
        """The runner, warmed up: on the declared sizes (measured: footprint.py), then on the
        model's recent batches when the broker sent them (replay.py); what the replay did, and
        the warm-up's seconds. Each phase is told to the broker as it begins."""
        gauge = Gauge(self.device)
        self._tell(key, "loading", t0)
        try:
            runner, weights = gauge.load(lambda: _runner_class(spec)(spec, self.device))
        except Exception as exc:
            raise LoadFailed(_reason(exc, "load"), exc) from None
        warm_t0 = self._tell(key, "warming", t0)
        try:
            warm_measured(runner, gauge, weights)
            replayed = warm_replay(runner, spec.replay) if spec.replay and isinstance(runner, ModelRunner) else None
        except Exception as exc:
            raise LoadFailed(_reason(exc, "warmup"), exc) from None
        return runner, replayed, time.perf_counter() - warm_t0

    def _tell(self, key: str, phase: str, t0: float) -> float:
        """Tell the broker a load's new phase (its seconds so far); returns when the phase began."""
        now = time.perf_counter()
        self.sock.send(encode(LoadPhase(worker_id=self.worker_id, key=key, phase=phase, seconds=now - t0)))
        return now

    def unload(self, key: str) -> ModelUnloaded:
        """Drop one model and give its memory back; a model not loaded is answered all the same."""
        rss_before = rss_bytes()
        runner = self.runners.pop(key, None)
        module = _weak(runner.module) if runner is not None else None
        del runner
        # a full collection costs ~80 ms with torch loaded (it walks every object): only when a
        # reference cycle kept the module alive past its last reference
        release_memory(self.device, collect=module is not None and module() is not None, frozen_too=True)
        return ModelUnloaded(worker_id=self.worker_id, key=key, rss_before=rss_before, rss_after=rss_bytes())


def _runner_class(spec: ModelSpec) -> type:
    """As stage_runner.make_runner picks (read here, where tests replace ModelRunner)."""
    if spec.sequence is not None:   # its ModelLoaded.slots: the pool's
        return SequenceStageRunner if spec.format == "stage" else SequenceFileRunner
    if spec.format == "stage":
        return GeneratorRunner if spec.generator is not None else StageRunner
    return ModelRunner


def _weak(module) -> weakref.ref | None:
    try:
        return weakref.ref(module)
    except TypeError:   # a stage class with __slots__ and no __weakref__: collect to be sure
        return lambda: True


def _reason(exc: Exception, phase: str) -> str:
    if isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)):
        return "out_of_memory"
    if isinstance(exc, (FormatMismatch, ModelFormatError)):   # at load, or at an AOTInductor warm-up's edges
        return "format"
    if phase == "warmup":
        return "warmup"
    if isinstance(exc, ChecksumMismatch):
        return "checksum"
    if isinstance(exc, OSError):
        return "file"
    return "load"


def release_memory(device: torch.device, collect: bool = True, frozen_too: bool = False) -> None:
    """Collect what dropped models left in reference cycles (`frozen_too`: among the objects
    gc.freeze() set aside too: a start-up model's), empty torch's CUDA cache, and hand freed
    heap pages back to the OS (glibc keeps them for reuse otherwise)."""
    if collect and frozen_too:
        gc_watch.watch.collect_all()
    elif collect:
        gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    trim_heap()
