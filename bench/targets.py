"""What the load generator talks to, and the inputs it sends.

A target is a small picklable dataclass. Each generator process calls `open(seed)` once, each of
its threads `caller(i)` before the run (a function doing one request: it returns on success,
raises on failure; its connection and inputs are made then, so the measured window pays for
neither), and the process `close()` at the end.
"""
from __future__ import annotations

import http.client
import struct
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

VAR_LEN = 16
GENERATORS = ("random", "zeros")


def _shape(decl: dict[str, Any], batch: int = 1, var_len: int = VAR_LEN) -> tuple[int, ...]:
    """A declared tensor's shape with `batch` rows; -1 dims become `var_len`."""
    return (batch, *[var_len if d == -1 else int(d) for d in decl["shape"]])


def make_inputs(meta: dict[str, Any], batch: int = 1, seed: int = 0, var_len: int = VAR_LEN,
                kind: str = "random") -> dict[str, np.ndarray]:
    """One request's inputs: standard normal floats, integers in [0, 1000) (token-id-like), or zeros."""
    rng, out = np.random.default_rng(seed), {}
    for d in meta["inputs"]:
        size, dt = _shape(d, batch, var_len), np.dtype(d["dtype"])
        if kind == "zeros":
            x = np.zeros(size)
        elif dt == np.bool_:
            x = rng.integers(0, 2, size=size)
        elif np.issubdtype(dt, np.integer):
            x = rng.integers(0, min(np.iinfo(dt).max, 1000), size=size)
        else:
            x = rng.standard_normal(size=size)
        out[d["name"]] = x.astype(dt)
    return out


def tensor_bytes(decls: list[dict[str, Any]]) -> int:
    """Bytes of one row of the tensors declared by `decls` (a model's "inputs" or "outputs")."""
    return sum(int(np.prod(_shape(d))) * np.dtype(d["dtype"]).itemsize for d in decls)


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
        self.client.health()  # this thread's socket and handshake
        return lambda: infer(model, inputs, **kw)

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
        return self

    def caller(self, index: int) -> Caller:
        import zmq
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        frames = [struct.pack("<Q", self.reply_bytes), bytes(self.request_bytes)]
        timeout_ms = int(self.timeout * 1000)

        def call() -> None:
            sock.send_multipart(frames, copy=False)
            if not sock.poll(timeout_ms):
                raise CallError("TIMEOUT")
            sock.recv_multipart(copy=False)
        return call

    def close(self) -> None:
        self.ctx.destroy(linger=0)  # closes every socket made in caller()


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
        return self

    def caller(self, index: int) -> Caller:
        headers = {"Content-Type": "application/json", "Connection": "keep-alive"}
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

        def call() -> None:
            # http.client reconnects by itself after a close, its own (a response that closes the
            # connection, as gunicorn's sync workers send) or ours after an error
            try:
                conn.request("POST", self.path, body=self.body, headers=headers)
                resp = conn.getresponse()
                resp.read()
            except (OSError, http.client.HTTPException):
                conn.close()
                raise
            if resp.status != 200:
                raise CallError(f"HTTP_{resp.status}")
        return call

    def close(self) -> None:
        pass  # the process exits next, which closes its connections
