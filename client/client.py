"""The tgw client: a ZeroMQ DEALER over ipc:// (or tcp://) speaking the msgspec wire contract.

Thread safety: one Client may be shared by any number of threads; it opens one socket per
thread (ZeroMQ sockets are not thread-safe), so calls never serialise behind each other.
Not fork-safe: create a Client in each process.
"""
from __future__ import annotations

import itertools
import math
import os
import threading
import time
from typing import Any

import zmq

from tgw.shm.errors import Code, error_from_body, fail
from tgw.shm.paths import default_address, ipc_path
from tgw.shm.wire import PROTOCOL_VERSION, DecodeError, ErrorReply, Health, Hello, Infer, ListModels, Stats, \
    Status, encode, reply_decoder

from .tensors import ZERO_COPY_MIN, decode_outputs, encode_inputs

CONNECT_TIMEOUT_S = 5.0
REPLY_GRACE_S = 0.1  # past the timeout, for the broker's own DEADLINE_EXCEEDED (its sweep runs every 50 ms)
NO_TIMEOUT_WAIT_S = 600.0  # a request without timeout still stops waiting for a vanished broker


class ConnectError(ConnectionError):
    """No tgw broker answered at the address."""


class Client:
    def __init__(self, address: str | None = None, *, connect_timeout: float = CONNECT_TIMEOUT_S):
        self.address = address or default_address()
        self.connect_timeout = connect_timeout
        self._ctx = zmq.Context()
        self._local = threading.local()
        self._sockets: list[zmq.Socket] = []
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pid = os.getpid()
        self._closed = False
        self.server: str | None = None
        self._socket()  # connect and handshake now: a wrong address or protocol fails here

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close every thread's socket; call once the threads using this client are done."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for s in self._sockets:
                s.close(linger=0)
            self._sockets.clear()
        self._ctx.term()

    # ---- public calls ------------------------------------------------------------------------

    def infer(self, model: str, inputs: dict[str, Any], *, version: str | None = None,
              timeout: float | None = None, outputs: list[str] | None = None, priority: int = 0,
              compress: bool = False) -> dict[str, "np.ndarray"]:  # noqa: F821
        """Run `model` on `inputs` (name -> array with a leading batch dim); returns name -> array.

        `timeout` is in seconds (the model's configured timeout when None; 0 = already expired;
        negative is INVALID_ARGUMENT, as the broker rules); `compress` sends and receives
        lz4-compressed tensors (worth it for large, compressible tensors over tcp)."""
        if timeout is not None and not timeout >= 0:
            raise fail(Code.INVALID_ARGUMENT, f"timeout must be >= 0 seconds, got {timeout}", timeout=timeout)
        metas, frames = encode_inputs(inputs, compress)
        req = Infer(v=PROTOCOL_VERSION, id=next(self._ids), model=model, version=version, inputs=metas,
                    outputs=outputs, priority=priority, compress_outputs=compress,
                    timeout_ms=None if timeout is None else math.ceil(timeout * 1000))
        wait = NO_TIMEOUT_WAIT_S if timeout is None else timeout + REPLY_GRACE_S
        reply, tensor_frames = self._call(req, frames, wait)
        return decode_outputs(reply.outputs, tensor_frames)

    def models(self) -> list[dict]:
        reply, _ = self._call(ListModels(v=PROTOCOL_VERSION, id=next(self._ids)), [], self.connect_timeout)
        return [_model_dict(m) for m in reply.models]

    def health(self) -> dict:
        r, _ = self._call(Health(v=PROTOCOL_VERSION, id=next(self._ids)), [], self.connect_timeout)
        return {"live": r.live, "ready": r.ready, "models": dict(r.models), "workers": dict(r.workers)}

    def stats(self) -> dict:
        r, _ = self._call(Stats(v=PROTOCOL_VERSION, id=next(self._ids)), [], self.connect_timeout)
        return {"models": r.models, "processes": r.processes, "errors": r.errors}

    def status(self) -> dict:
        """What `tgw-broker status` shows: phase, uptime, workers (heartbeat figures, restarts,
        last death, crash-loop), models with their queues."""
        r, _ = self._call(Status(v=PROTOCOL_VERSION, id=next(self._ids)), [], self.connect_timeout)
        return {"phase": r.phase, "uptime_s": r.uptime_s, "workers": r.workers, "models": r.models,
                "snapshots": r.snapshots}

    # ---- plumbing ----------------------------------------------------------------------------

    def _socket(self) -> zmq.Socket:
        sock = getattr(self._local, "sock", None)
        if sock is not None:
            return sock
        if os.getpid() != self._pid:
            raise RuntimeError("tgw Client used after fork; create a Client in each process")
        with self._lock:
            if self._closed:
                raise RuntimeError("tgw Client is closed")
            path = ipc_path(self.address)
            if path is not None and not os.path.exists(path):
                raise ConnectError(f"no tgw broker at {self.address}: {path} does not exist")
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.address)
            self._sockets.append(sock)
        self._local.sock = sock
        try:
            reply, _ = self._call(Hello(v=PROTOCOL_VERSION, id=next(self._ids), client="tgw.client/py"), [],
                                  self.connect_timeout, sock=sock)
        except TimeoutError:
            raise ConnectError(f"no tgw broker answered at {self.address} within {self.connect_timeout:.0f}s") from None
        self.server = reply.server
        return sock

    def _call(self, msg, frames: list, wait_s: float, sock: zmq.Socket | None = None):
        sock = sock or self._socket()
        copy = sum(len(f) for f in frames) < ZERO_COPY_MIN
        sock.send_multipart([encode(msg), *frames], copy=copy)
        deadline = time.monotonic() + wait_s
        while True:
            # stale replies to abandoned requests must not extend this request's wait
            if not sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                if isinstance(msg, Hello):
                    raise TimeoutError
                raise fail(Code.DEADLINE_EXCEEDED, f"no reply from {self.address} within {wait_s:.1f}s",
                           request_id=msg.id)
            parts = sock.recv_multipart(copy=False)
            try:
                reply = reply_decoder.decode(parts[0].buffer)
            except DecodeError as exc:
                raise fail(Code.INTERNAL, f"undecodable reply from broker: {exc}") from None
            if reply.id != msg.id:
                continue  # a late answer to an earlier request this thread gave up on
            if isinstance(reply, ErrorReply):
                raise error_from_body(reply.error)
            return reply, parts[1:]


def _model_dict(m) -> dict:
    io = lambda ts: [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in ts]  # noqa: E731
    return {"name": m.name, "versions": list(m.versions), "default_version": m.default_version,
            "max_batch_size": m.max_batch_size, "inputs": io(m.inputs), "outputs": io(m.outputs),
            "ready": m.ready}
