"""What the load generator talks to (tgw native, raw zmq echo, HTTP, gRPC), and the inputs it sends.

A target is a small picklable dataclass. Each generator process calls `open(seed)` once, each of
its threads `caller(i)` before the run (a function doing one request: it returns on success,
raises on failure; its connection and inputs are made then, so the measured window pays for
neither), and the process `close()` at the end.
"""
from __future__ import annotations

import json
import socket
import struct
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional

import numpy as np

VAR_LEN = 16
GENERATORS = ("random", "zeros")
HEADER_LENGTH = "Inference-Header-Content-Length"  # KServe v2's binary tensor extension: the JSON header's bytes


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


def v2_datatype(dtype: Any) -> str:
    """A numpy (or torch) dtype's KServe v2 datatype name: FP32, INT64, UINT8, BOOL..."""
    dt = np.dtype(str(dtype).removeprefix("torch."))
    return "BOOL" if dt.kind == "b" else {"f": "FP", "i": "INT", "u": "UINT"}[dt.kind] + str(dt.itemsize * 8)


def v2_body(meta: dict[str, Any], binary: bool = False) -> tuple[bytes, int]:
    """One request of `make_inputs(meta)` as a KServe v2 / Open Inference Protocol body, and the
    length of its JSON header. JSON: `{"inputs": [{name, shape, datatype, data (flat)}]}`, the
    header being the whole body. binary: the binary tensor extension, a JSON header whose inputs
    give `parameters.binary_data_size` (and which asks for binary outputs) followed by the raw
    little-endian bytes of each input in order; the header length goes in the request header
    HEADER_LENGTH."""
    inputs = make_inputs(meta)
    specs = [{"name": k, "shape": list(v.shape), "datatype": v2_datatype(v.dtype)} for k, v in inputs.items()]
    if not binary:
        body = json.dumps({"inputs": [{**s, "data": v.ravel().tolist()} for s, v in zip(specs, inputs.values())]})
        return body.encode(), len(body)  # ASCII
    raw = [v.astype(v.dtype.newbyteorder("<"), copy=False).tobytes() for v in inputs.values()]
    header = json.dumps({"inputs": [{**s, "parameters": {"binary_data_size": len(b)}} for s, b in zip(specs, raw)],
                         "parameters": {"binary_data_output": True}}).encode()
    return b"".join([header, *raw]), len(header)


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
    body_path: str  # the body posted as it is (wrk posts the same file)
    timeout: float = 30.0
    label: str = "http"
    model: str = ""  # the model it calls, for the broker's stats of a tgw row
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)  # sent with every request, as wrk's Lua script does

    def open(self, seed: int) -> "HttpTarget":
        with open(self.body_path, "rb") as f:
            self.body = f.read()
        return self

    def caller(self, index: int) -> Caller:
        fields = {"Host": f"{self.host}:{self.port}", "Content-Type": self.content_type,
                  "Content-Length": str(len(self.body)), **self.headers}
        request = "".join([f"POST {self.path} HTTP/1.1\r\n", *(f"{k}: {v}\r\n" for k, v in fields.items()),
                           "\r\n"]).encode("latin-1") + self.body
        conn = HttpConnection(self.host, self.port, self.timeout)

        def call() -> None:
            status = conn.exchange(request)
            if status != 200:
                raise CallError(f"HTTP_{status}")
        return call

    def close(self) -> None:
        pass  # the process exits next, which closes its connections


class HttpConnection:
    """One keep-alive HTTP/1.1 connection for the fallback generator, as lean as a Python caller
    gets (http.client parses every reply's headers with the email package and writes a body
    apart from its headers): a request goes out in one write, as wrk sends it, and its reply is
    read by Content-Length. Reopened after the server closes it (gunicorn's sync workers answer
    `Connection: close`) or after an error."""
    keep_body = False   # True: each reply's body is kept in .body (else it is only skipped)

    def __init__(self, host: str, port: int, timeout: float):
        self.address, self.timeout = (host, port), timeout
        self.sock: Optional[socket.socket] = None
        self.buf = bytearray()

    def exchange(self, request: bytes) -> int:
        """Send one request and read its reply; returns the status code."""
        if self.sock is None:
            self.sock = socket.create_connection(self.address, self.timeout)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self.sock.sendall(request)
            status, keep = self.reply()
        except (OSError, ValueError):
            self.close()
            raise
        if not keep:
            self.close()
        return status

    def reply(self) -> tuple[int, bool]:
        while (end := self.buf.find(b"\r\n\r\n")) < 0:
            self.fill()
        status_line, *lines = self.buf[:end].decode("latin-1").split("\r\n")
        fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
        if "content-length" not in fields:
            raise ValueError(f"a reply without Content-Length: {status_line}")
        total = end + 4 + int(fields["content-length"])
        while len(self.buf) < total:
            self.fill()
        if self.keep_body:
            self.body = bytes(self.buf[end + 4:total])
        del self.buf[:total]
        return int(status_line.split(" ", 2)[1]), \
            status_line.startswith("HTTP/1.1") and fields.get("connection", "").lower() != "close"

    def fill(self) -> None:
        chunk = self.sock.recv(1 << 18)
        if not chunk:
            raise ConnectionResetError("the server closed the connection")
        self.buf += chunk

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock, self.buf = None, bytearray()


def v2_target(url: str, model: str, body_path: str, header: int, binary: bool, label: str = "http") -> HttpTarget:
    """`POST {url}/v2/models/{model}/infer` of a v2_body() file: JSON, or the binary extension with
    its content type and HEADER_LENGTH (`header`: the JSON header's bytes). url: http://host:port."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    extra = {"content_type": "application/octet-stream", "headers": {HEADER_LENGTH: str(header)}} if binary else {}
    return HttpTarget(host, int(port), f"/v2/models/{model}/infer", body_path, label=label, model=model, **extra)


# ---- gRPC: the compare rows tgw_grpc and tgw_grpc_stream ------------------------------------------
# The gRPC rows' targets: KServe v2 ModelInfer on tgw's gRPC face, as tritonclient.grpc sends it
# (inputs in raw_input_contents, outputs back raw), one channel (one HTTP/2 connection) per caller
# coroutine, as the HTTP rows hold one keep-alive connection per caller: unary calls (`infer`), or
# one ModelStreamInfer stream per caller, a request written and its answer read in turn
# (`start_stream` + `async_stream_infer`, perf_analyzer's --streaming). The callers are grpc.aio
# coroutines on one loop per generator process (loadgen's `async_caller`): Python's leanest gRPC
# client (its synchronous one spends more CPU per call, which on a small box is taken from the
# server being measured).
#
# The request is serialized once per caller and the reply is not parsed beyond its status (the
# generator's CPU would otherwise be measured with the server's); `check()` parses one reply in
# full, before the window, so a row never counts answers that are wrong. grpc is imported in the
# generator's (spawned) processes only: a gRPC channel does not survive a fork.

METHOD = "/inference.GRPCInferenceService/ModelInfer"
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"


def infer_request(model: str, inputs: dict) -> Any:
    from tgw.broker.faces.grpc.proto import grpc_service_pb2 as pb
    tensors = [pb.ModelInferRequest.InferInputTensor(name=k, datatype=v2_datatype(v.dtype), shape=list(v.shape))
               for k, v in inputs.items()]
    raw = [v.astype(v.dtype.newbyteorder("<"), copy=False).tobytes() for v in inputs.values()]
    return pb.ModelInferRequest(model_name=model, inputs=tensors, raw_input_contents=raw)


@dataclass
class GrpcTarget:
    address: str               # host:port of the gRPC face
    model: str
    meta: dict[str, Any]       # the model's declaration (its inputs), as the other targets read it
    timeout: float = 30.0
    label: str = "tgw_grpc"

    def open(self, seed: int) -> "GrpcTarget":
        self.seed, self.channels = seed, []
        return self

    def channel(self):
        import grpc
        # a local subchannel pool: each caller its own connection, not one shared by every channel
        channel = grpc.aio.insecure_channel(self.address, options=[("grpc.use_local_subchannel_pool", 1),
                                                                   ("grpc.max_receive_message_length", -1),
                                                                   ("grpc.max_send_message_length", -1)])
        self.channels.append(channel)
        return channel

    async def aclose(self) -> None:
        """On the callers' loop, before it closes: the channels (and their streams) end cleanly."""
        for channel in self.channels:
            await channel.close()

    def body(self, index: int) -> bytes:
        return infer_request(self.model, make_inputs(self.meta, 1, self.seed * 1000 + index)).SerializeToString()

    async def async_caller(self, index: int) -> Callable[[], Awaitable[None]]:
        import grpc
        body, timeout = self.body(index), self.timeout
        call = self.channel().unary_unary(METHOD)   # bytes in, bytes out: no (de)serializer
        self.check(await call(body, timeout=timeout))

        async def infer() -> None:
            try:
                await call(body, timeout=timeout)
            except grpc.RpcError as err:
                raise CallError(err.code().name, err.details() or "") from None
        return infer

    def check(self, reply: bytes) -> None:
        """One reply in full: every declared output, with as many raw bytes as its shape says."""
        from tgw.broker.faces.grpc.proto import grpc_service_pb2 as pb
        import numpy as np
        msg = pb.ModelInferResponse.FromString(reply)
        names = [o.name for o in msg.outputs]
        wanted = [o["name"] for o in self.meta["outputs"]]
        if sorted(names) != sorted(wanted) or len(msg.raw_output_contents) != len(names):
            raise CallError("BAD_REPLY", f"outputs {names}, raw contents {len(msg.raw_output_contents)}; "
                                         f"declared {wanted}")
        for out, raw in zip(msg.outputs, msg.raw_output_contents):
            itemsize = np.dtype(next(o["dtype"] for o in self.meta["outputs"] if o["name"] == out.name)).itemsize
            if len(raw) != itemsize * int(np.prod(out.shape)):
                raise CallError("BAD_REPLY", f"output {out.name}: {len(raw)} bytes for shape {list(out.shape)}")

    def close(self) -> None:
        pass  # the process exits next, which closes its channels


@dataclass
class GrpcStreamTarget(GrpcTarget):
    label: str = "tgw_grpc_stream"

    async def async_caller(self, index: int) -> Callable[[], Awaitable[None]]:
        import grpc
        from tgw.broker.faces.grpc.proto import grpc_service_pb2 as pb
        body = self.body(index)
        stream = self.channel().stream_stream(STREAM)()   # bytes both ways
        await stream.write(body)
        first = pb.ModelStreamInferResponse.FromString(await stream.read())
        if first.error_message:
            raise CallError("STREAM_ERROR", first.error_message)
        self.check(first.infer_response.SerializeToString())

        async def infer() -> None:
            try:
                await stream.write(body)
                answer = await stream.read()
            except grpc.RpcError as err:
                raise CallError(err.code().name, err.details() or "") from None
            if answer[:1] == b"\n":   # field 1's tag (error_message): set only on an error answer
                raise CallError("STREAM_ERROR", pb.ModelStreamInferResponse.FromString(answer).error_message)
        return infer
