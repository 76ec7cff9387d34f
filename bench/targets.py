"""What the load generator talks to. Each target is a small picklable spec that is opened once
per generator process; `caller()` returns a per-thread function doing one request.

A caller returns normally on success and raises on failure; `error_code()` maps the exception
to the code the summary counts (a tgw error code, "TIMEOUT", "HTTP_<status>", or the
exception's class name).

* TgwTarget     - the native client library (`tgw.client.Client`), one Client per process
                  shared by its threads (the client keeps one socket per thread).
* ZmqEchoTarget - raw pyzmq DEALER -> the transport floor's ROUTER broker (transport.py).
* HttpTarget    - keep-alive HTTP POST of a pre-encoded JSON body (the Python fallback when
                  `wrk` is unavailable; see wrk.py).
"""
from __future__ import annotations

import http.client
import struct
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

Caller = Callable[[], None]


class CallError(Exception):
    def __init__(self, code: str, message: str = ""):
        super().__init__(f"{code}: {message}" if message else code)
        self.code = code


def error_code(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    if code is not None:
        return str(getattr(code, "value", code))
    return type(exc).__name__


@dataclass
class TgwTarget:
    address: str
    model: str
    batch: int = 1
    version: Optional[str] = None
    timeout: Optional[float] = None
    var_len: int = 16
    input_kind: str = "random"
    label: str = "tgw"

    def open(self, seed: int) -> "_TgwSession":
        return _TgwSession(self, seed)


class _TgwSession:
    def __init__(self, t: TgwTarget, seed: int):
        from tgw.client import Client
        from tgw.bench.inputs import find_model, make_inputs
        self.t, self.seed = t, seed
        self.client = Client(t.address)
        self.meta = find_model(self.client.models(), t.model)
        self._make = lambda i: make_inputs(self.meta, t.batch, seed * 1000 + i, t.var_len, t.input_kind)

    def caller(self, index: int) -> Caller:
        inputs = self._make(index)
        infer, t = self.client.infer, self.t
        kw: dict[str, Any] = {}
        if t.version is not None:
            kw["version"] = t.version
        if t.timeout is not None:
            kw["timeout"] = t.timeout

        def call() -> None:
            infer(t.model, inputs, **kw)
        return call

    def thread_init(self) -> None:
        self.client.health()  # opens this thread's socket and does the handshake before the run

    def close(self) -> None:
        self.client.close()


@dataclass
class ZmqEchoTarget:
    address: str
    request_bytes: int = 1024
    reply_bytes: int = 64
    timeout: float = 30.0
    label: str = "transport-floor"

    def open(self, seed: int) -> "_ZmqSession":
        return _ZmqSession(self)


class _ZmqSession:
    def __init__(self, t: ZmqEchoTarget):
        import zmq
        self.t, self.zmq = t, zmq
        self.ctx = zmq.Context()
        self.sockets: list[Any] = []
        self.lock = threading.Lock()

    def caller(self, index: int) -> Caller:
        zmq, t = self.zmq, self.t
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(t.address)
        with self.lock:
            self.sockets.append(sock)
        header = struct.pack("<Q", t.reply_bytes)
        payload = bytes(t.request_bytes)
        timeout_ms = int(t.timeout * 1000)

        def call() -> None:
            sock.send_multipart([header, payload], copy=False)
            if not sock.poll(timeout_ms):
                raise CallError("TIMEOUT")
            sock.recv_multipart(copy=False)
        return call

    def close(self) -> None:
        for s in self.sockets:
            s.close(0)
        self.ctx.term()


@dataclass
class HttpTarget:
    host: str
    port: int
    path: str
    body: bytes = field(repr=False, default=b"")
    timeout: float = 30.0
    label: str = "http"

    def open(self, seed: int) -> "_HttpSession":
        return _HttpSession(self)


class _HttpSession:
    def __init__(self, t: HttpTarget):
        self.t = t
        self.conns: list[http.client.HTTPConnection] = []

    def caller(self, index: int) -> Caller:
        t = self.t
        headers = {"Content-Type": "application/json", "Connection": "keep-alive"}
        box = [http.client.HTTPConnection(t.host, t.port, timeout=t.timeout)]
        self.conns.append(box[0])

        def call() -> None:
            try:
                box[0].request("POST", t.path, body=t.body, headers=headers)
                resp = box[0].getresponse()
                resp.read()
            except (OSError, http.client.HTTPException):
                box[0].close()  # reconnect on the next call (sync servers close connections)
                box[0] = http.client.HTTPConnection(t.host, t.port, timeout=t.timeout)
                self.conns.append(box[0])
                raise
            if resp.status != 200:
                raise CallError(f"HTTP_{resp.status}")
            if resp.will_close:
                box[0].close()
        return call

    def close(self) -> None:
        for c in self.conns:
            c.close()
