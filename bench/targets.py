"""What the load generator talks to, and the inputs it sends.

A target is a small picklable dataclass. Each generator process calls `open(seed)` once, then
`caller(i)` per thread (a function doing one request: it returns on success, raises on failure),
`thread_init()` (if any) on each thread before the run, and `close()` at the end. TgwTarget uses
the native client (one per process; it keeps a socket per thread), ZmqEchoTarget raw pyzmq
against the transport floor, HttpTarget keep-alive HTTP POSTs of a JSON body file (wrk's Python
fallback). Inputs follow a model's declaration, -1 dims get `var_len`; they are made once per
thread before the run, so the generator spends no CPU on random numbers while it measures.
"""
from __future__ import annotations

import http.client
import struct
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

VAR_LEN = 16
GENERATORS = ("random", "zeros")


def _shape(decl: dict[str, Any], batch: int, var_len: int) -> tuple[int, ...]:
    return (batch, *[var_len if d == -1 else int(d) for d in decl["shape"]])


def make_inputs(meta: dict[str, Any], batch: int = 1, seed: int = 0, var_len: int = VAR_LEN,
                kind: str = "random") -> dict[str, np.ndarray]:
    """One request's inputs: standard normal floats, integers in [0, 1000) (token-id-like), or zeros."""
    rng = np.random.default_rng(seed)
    out = {}
    for d in meta["inputs"]:
        shape, dt = _shape(d, batch, var_len), np.dtype(d["dtype"])
        if kind == "zeros":
            out[d["name"]] = np.zeros(shape, dt)
        elif dt == np.bool_:
            out[d["name"]] = rng.integers(0, 2, size=shape).astype(np.bool_)
        elif np.issubdtype(dt, np.integer):
            out[d["name"]] = rng.integers(0, min(np.iinfo(dt).max, 1000), size=shape, dtype=dt)
        else:
            out[d["name"]] = rng.standard_normal(size=shape).astype(dt)
    return out


def tensor_bytes(decls: list[dict[str, Any]], batch: int = 1, var_len: int = VAR_LEN) -> int:
    """Bytes of the tensors declared by `decls` (a model's "inputs" or "outputs")."""
    return sum(int(np.prod(_shape(d, batch, var_len))) * np.dtype(d["dtype"]).itemsize for d in decls)


def find_model(models: list[dict[str, Any]], name: str) -> dict[str, Any]:
    for m in models:
        if m["name"] == name:
            return m
    raise LookupError(f"model {name!r} is not served; served: {', '.join(m['name'] for m in models)}")


class CallError(Exception):
    def __init__(self, code: str, message: str = ""):
        super().__init__(f"{code}: {message}" if message else code)
        self.code = code


def error_code(exc: BaseException) -> str:
    """The code a failure is counted under: a tgw error code, "TIMEOUT", "HTTP_<status>", or the class name."""
    code = getattr(exc, "code", None)
    return type(exc).__name__ if code is None else str(getattr(code, "value", code))


Caller = Callable[[], None]


@dataclass
class TgwTarget:
    address: str
    model: str
    batch: int = 1
    version: Optional[str] = None
    timeout: Optional[float] = None
    var_len: int = VAR_LEN
    input_kind: str = "random"
    label: str = "tgw"

    def open(self, seed: int) -> "TgwTarget":
        from tgw.client import Client
        self.client = Client(self.address)
        self.meta = find_model(self.client.models(), self.model)
        self.seed = seed
        return self

    def caller(self, index: int) -> Caller:
        inputs = make_inputs(self.meta, self.batch, self.seed * 1000 + index, self.var_len, self.input_kind)
        kw = {k: v for k, v in (("version", self.version), ("timeout", self.timeout)) if v is not None}
        infer, model = self.client.infer, self.model
        return lambda: infer(model, inputs, **kw)

    def thread_init(self) -> None:
        self.client.health()  # this thread's socket and handshake, before the run

    def close(self) -> None:
        self.client.close()


@dataclass
class ZmqEchoTarget:
    address: str
    request_bytes: int = 1024
    reply_bytes: int = 64
    timeout: float = 30.0
    label: str = "transport-floor"

    def open(self, seed: int) -> "ZmqEchoTarget":
        import zmq
        self.ctx = zmq.Context()
        self.sockets: list[Any] = []
        return self

    def caller(self, index: int) -> Caller:
        import zmq
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        self.sockets.append(sock)  # callers are made in one thread, before the run
        frames = [struct.pack("<Q", self.reply_bytes), bytes(self.request_bytes)]
        timeout_ms = int(self.timeout * 1000)

        def call() -> None:
            sock.send_multipart(frames, copy=False)
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
    body_path: str  # a JSON body; wrk posts the same file
    timeout: float = 30.0
    label: str = "http"

    def open(self, seed: int) -> "HttpTarget":
        with open(self.body_path, "rb") as f:
            self.body = f.read()
        self.boxes: list[list[http.client.HTTPConnection]] = []
        return self

    def _connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def caller(self, index: int) -> Caller:
        headers = {"Content-Type": "application/json", "Connection": "keep-alive"}
        box = [self._connect()]  # this thread's connection, replaced after an error
        self.boxes.append(box)

        def call() -> None:
            try:
                box[0].request("POST", self.path, body=self.body, headers=headers)
                resp = box[0].getresponse()
                resp.read()
            except (OSError, http.client.HTTPException):
                box[0].close()  # reconnect on the next call (sync servers close connections)
                box[0] = self._connect()
                raise
            if resp.status != 200:
                raise CallError(f"HTTP_{resp.status}")
            if resp.will_close:
                box[0].close()
        return call

    def close(self) -> None:
        for box in self.boxes:
            box[0].close()
