"""Entry of a worker process: `python -m tgw.workers --worker-id N --device cpu ...`.

run_worker only wires things: title, signals, parent death, handshake, loop, death notice.
The supervisor (in the broker) spawns it, owns its segment and restarts it.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib
import os
import signal
import sys

import setproctitle
import torch
import zmq

from tgw.shm.segment import Segment
from tgw.shm.wire import PROTOCOL_VERSION, LoadModels, WorkerFailed, WorkerHello, WorkerReady, encode, model_key, \
    to_worker_decoder

from .cuda_ipc import device_memory, device_uuid
from .device_io import HOST_MEMORY
from .heartbeat import Beacon, Progress
from .loader import MAX_ERROR_CHARS, Loader, error_text
from .runner import ModelRunner
from .serve import Server
from .tracing import death_notice, observer_from_env, setup_logging

PR_SET_PDEATHSIG = 1


def _prctl(option: int, arg) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tgw-worker")
    ap.add_argument("--worker-id", type=int, required=True)
    ap.add_argument("--identity", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--segment", required=True)
    ap.add_argument("--input-bytes", type=int, required=True)
    ap.add_argument("--output-bytes", type=int, required=True)
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cpus", default="", help="comma-separated cores to pin to")
    ap.add_argument("--cuda-host-memory", choices=HOST_MEMORY, default="register",
                    help="how a CUDA worker's ring is page-locked for copies (workers/device_io.py)")
    ap.add_argument("--heartbeat-s", type=float, default=1.0, help="seconds between heartbeats")
    ap.add_argument("--preload", default="",
                    help="comma-separated modules to import, .py files or .so libraries to load before any model "
                         "(they register the custom ops models call)")
    return ap.parse_args(argv)


def _setup_process(args: argparse.Namespace) -> torch.device:
    device = torch.device(args.device)
    if device.type == "cuda":   # first: every later CUDA call (a context, a stream) is on this GPU
        torch.cuda.set_device(device)
    setproctitle.setproctitle(f"tgw-worker {args.worker_id} {args.device}")  # what ps and top show
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the broker holds our segment: die with it
    if os.getppid() == 1:
        sys.exit("tgw worker: parent already gone")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the broker, which stops us in order
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    torch.set_num_threads(args.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    return device


def preload(entries: str) -> None:
    """Import each module (a name, or a .py file by path) or load each .so with torch.ops.load_library.

    Raises RuntimeError naming the entry that failed."""
    for entry in filter(None, (e.strip() for e in entries.split(","))):
        try:
            if entry.endswith(".so"):
                torch.ops.load_library(entry)
            elif entry.endswith(".py"):  # by path: its folder joins sys.path so a second mention is a no-op
                sys.path.insert(0, os.path.dirname(os.path.abspath(entry)))
                importlib.import_module(os.path.basename(entry)[:-3])
            else:
                importlib.import_module(entry)
        except Exception as exc:
            raise RuntimeError(f"preload {entry!r} failed: {type(exc).__name__}: {exc}") from exc


def _load(msg: LoadModels, device: torch.device, worker_id: int,
          runners: dict[str, ModelRunner]) -> WorkerReady | WorkerFailed:
    """Load the start-up models into `runners`, all or none; the first that fails fails the worker.
    The answer names only these: the loader thread reports its own loads."""
    loaded = {}
    for spec in msg.models:
        try:
            runner = ModelRunner(spec, device)
            runner.warm_up()
        except Exception as exc:
            return WorkerFailed(worker_id=worker_id, model=model_key(spec.name, spec.version),
                                error=error_text(exc))
        loaded[runner.key] = runner
    runners.update(loaded)
    return WorkerReady(worker_id=worker_id, models=sorted(loaded),
                       sizes={key: runner.nbytes for key, runner in loaded.items()})


def run_worker(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging()
    device = _setup_process(args)
    observer = observer_from_env()   # what the broker asked for: spans, slow and failed batch lines
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, args.identity.encode())
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(args.endpoint)
    segment = Segment.attach(args.segment)
    progress = Progress()
    # beats from here on: a worker stuck importing or loading models is seen as hung
    beacon = Beacon(ctx, args.endpoint, args.identity.encode(), args.worker_id, progress, args.heartbeat_s, device)
    beacon.start()
    runners: dict[str, ModelRunner] = {}  # one dict: the loader adds and removes, the serving loop reads
    loader = Loader(ctx, args.endpoint, args.identity.encode(), args.worker_id, runners, device)
    loader.start()  # before the hello: serving loads by the time the broker knows this worker
    try:
        failure = _preload(args)
        sock.send(encode(WorkerHello(v=PROTOCOL_VERSION, worker_id=args.worker_id, pid=os.getpid(),
                                     device_uuid=device_uuid(device), device_memory=device_memory(device))))
        msg = to_worker_decoder.decode(sock.recv())
        if not isinstance(msg, LoadModels):
            raise RuntimeError(f"expected a load message first, got {type(msg).__name__}")
        answer = failure or _load(msg, device, args.worker_id, runners)
        sock.send(encode(answer))
        if isinstance(answer, WorkerFailed):
            return 1
        Server(sock, segment, args.input_bytes, args.output_bytes, runners, progress, observer, device,
               args.cuda_host_memory).serve()
        return 0
    except Exception:
        death_notice("worker failed")  # the supervisor logs our stderr and restarts us
        return 1
    finally:
        if observer is not None:
            observer.close()
        loader_stopped = loader.stop()
        beacon.stop()
        sock.close()
        if loader_stopped:  # else a load still running holds its socket, and term() would wait for it
            ctx.term()
        try:
            segment.close()
        except BufferError:
            pass  # a view is still alive; the mapping goes with the process


def _preload(args: argparse.Namespace) -> WorkerFailed | None:
    """Run the preloads; a failure answers the load message, as a model that fails to load does."""
    try:
        preload(args.preload)
    except RuntimeError as exc:
        death_notice(f"preload failed: {exc}")
        return WorkerFailed(worker_id=args.worker_id, model="<preload>", error=str(exc)[:MAX_ERROR_CHARS])
    return None


def main() -> None:
    sys.exit(run_worker())
