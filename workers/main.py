"""Entry of a worker process: `python -m tgw.workers START`, START the WorkerStart the supervisor
passes as JSON (tgw/shm/wire_start.py: device, ring, endpoint, threads, logging, tracing, ...).

run_worker only wires things: title, signals, parent death, handshake, loop, death notice.
The supervisor (in the broker) spawns it, owns its segment and restarts it.
"""
from __future__ import annotations

import ctypes
import importlib
import os
import signal
import sys

import setproctitle
import torch
import zmq

from tgw.shm import gc_watch
from tgw.shm.segment import Segment
from tgw.shm.wire_start import BadStart, WorkerStart, decode_start
from tgw.shm.wire import PROTOCOL_VERSION, LoadModels, WorkerFailed, WorkerHello, encode, to_worker_decoder

from .cuda_faults import CudaFault
from .device_identity import device_memory, device_uuid
from .heartbeat import Beacon
from .progress import Progress
from .load_errors import MAX_ERROR_CHARS
from .loader import Loader
from .runner import ModelRunner
from .serve import Server
from .tracing import Observer, death_notice, setup_logging

PR_SET_PDEATHSIG = 1
FAULT_EXIT = 3   # a sticky CUDA error ended the worker (WorkerFault sent first)


def _prctl(option: int, arg) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0)
    except (OSError, AttributeError):
        pass


USAGE = "usage: python -m tgw.workers START (START: a WorkerStart as JSON, tgw/shm/wire_start.py)"


def parse_start(argv: list[str] | None = None) -> WorkerStart:
    """The one argument, decoded; BadStart (naming the field) for anything else."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        raise BadStart(USAGE)
    return decode_start(argv[0])


def _setup_process(start: WorkerStart) -> torch.device:
    device = torch.device(start.device)
    if device.type == "cuda":   # first: every later CUDA call (a context, a stream) is on this GPU
        torch.cuda.set_device(device)
    setproctitle.setproctitle(f"tgw-worker {start.worker_id} {start.device}")  # what ps and top show
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the broker holds our segment: die with it
    if os.getppid() == 1:
        sys.exit("tgw worker: parent already gone")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the broker, which stops us in order
    if start.cpus:
        os.sched_setaffinity(0, set(start.cpus))
    torch.set_num_threads(start.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    return device


def preload(entries: str | list[str]) -> None:
    """Import each module (a name, or a .py file by path) or load each .so with torch.ops.load_library;
    `entries` a list, or one string of them comma-separated.

    Raises RuntimeError naming the entry that failed."""
    for entry in filter(None, (e.strip() for e in (entries.split(",") if isinstance(entries, str) else entries))):
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


def run_worker(argv: list[str] | None = None) -> int:
    try:
        start = parse_start(argv)
    except BadStart as exc:   # the supervisor logs our stderr: the field at fault is named there
        print(f"tgw worker: {exc}", file=sys.stderr)
        return 2
    setup_logging(start.log_format, start.worker_id)
    gc_watch.watch.install()   # every collection timed from the start (status `gc.workers`)
    device = _setup_process(start)
    # what the broker asked for: spans, slow and failed batch lines (None: nothing per batch)
    observer = Observer(start.tracing, start.slow_ms) if start.tracing or start.slow_ms else None
    identity = start.identity.encode()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(start.endpoint)
    segment = Segment.attach(start.segment)
    progress = Progress()
    # beats from here on: a worker stuck importing or loading models is seen as hung
    beacon = Beacon(ctx, start.endpoint, identity, start.worker_id, progress, start.heartbeat_s, device)
    beacon.start()
    runners: dict[str, ModelRunner] = {}  # one dict: the loader adds and removes, the serving loop reads
    # its socket connects now; its thread starts with the start-up models, once the broker named them
    loader = Loader(ctx, start.endpoint, identity, start.worker_id, runners, device)
    try:
        failure = _preload(start)
        # made before the hello, which reports its ring's page-locking as it is in effect
        server = Server(sock, segment, start.input_bytes, start.output_bytes, runners, progress, observer, device,
                        start.host_memory, worker_id=start.worker_id)
        sock.send(encode(WorkerHello(v=PROTOCOL_VERSION, worker_id=start.worker_id, pid=os.getpid(),
                                     device_uuid=device_uuid(device), device_memory=device_memory(device),
                                     host_memory=server.host_memory)))
        msg = to_worker_decoder.decode(sock.recv())
        if not isinstance(msg, LoadModels):
            raise RuntimeError(f"expected a load message first, got {type(msg).__name__}")
        if failure is not None:
            sock.send(encode(failure))
            return 1
        # the loader loads them one by one while the loop serves each that is in; it tells the
        # broker WorkerReady after the last, or WorkerFailed (then the broker sends Stop)
        loader.start(msg.models, freeze=start.gc_freeze)
        server.serve()
        return 1 if loader.startup_failed else 0   # a failed start-up is a failure, stopped or not
    except CudaFault as fault:   # told to the broker already; this process's CUDA context is broken
        print(f"tgw worker {start.worker_id}: sticky CUDA error in batch {fault.batch_id}, exiting: {fault.error}",
              file=sys.stderr)
        return FAULT_EXIT
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


def _preload(start: WorkerStart) -> WorkerFailed | None:
    """Run the preloads; a failure answers the load message, as a model that fails to load does."""
    try:
        preload(start.preload)
    except RuntimeError as exc:
        death_notice(f"preload failed: {exc}")
        return WorkerFailed(worker_id=start.worker_id, model="<preload>", error=str(exc)[:MAX_ERROR_CHARS])
    return None


def main() -> None:
    sys.exit(run_worker())
