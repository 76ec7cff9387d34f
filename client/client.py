"""The tgw client: a ZeroMQ DEALER over ipc:// (or tcp://) speaking the msgspec wire contract.

Thread safety: one Client may be shared by any number of threads; it opens one socket per
thread (ZeroMQ sockets are not thread-safe), so calls never serialise behind each other.
Not fork-safe: create a Client in each process.

Security (docs/PROTOCOL.md §1b): `token` (default: $TGW_TOKEN) travels in every request, for a
broker configured with `server.auth_token_file`; `server_key` (default: $TGW_SERVER_KEY), the
broker's CURVE public key, encrypts the connection with an ephemeral client key pair. The
broker listens on tcp:// only with CURVE, so a tcp:// address needs the server key.
"""
from __future__ import annotations

import itertools
import math
import os
import threading
import time
from typing import Any, NamedTuple

import zmq
import zmq.auth
from zmq.utils import z85

from tgw.shm.errors import Code, error_from_body, fail
from tgw.shm.paths import default_address, ipc_path
from tgw.shm.wire import PROTOCOL_VERSION, DecodeError, ErrorReply, Health, Hello, Infer, ListModels, Metadata, \
    Stats, Status, as_builtins, encode, reply_decoder

from .tensors import ZERO_COPY_MIN, decode_outputs, encode as encode_tensors

CONNECT_TIMEOUT_S = 5.0
# plain ints: pyzmq's enum flags cost an enum operation per use, and its send_multipart,
# recv_multipart and Socket.poll helpers several (Python-level option lookups, a Poller per
# call), which is most of what this client spends per call besides the socket itself
SNDMORE, POLLIN, ENOTSUP = int(zmq.SNDMORE), int(zmq.POLLIN), int(zmq.ENOTSUP)
REPLY_GRACE_S = 0.1  # past the timeout, for the broker's own DEADLINE_EXCEEDED (its sweep runs every 50 ms)
NO_TIMEOUT_WAIT_S = 600.0  # a request without timeout still stops waiting for a vanished broker


class InferResult(NamedTuple):
    """Client.infer_with_meta's answer."""
    outputs: dict[str, Any]     # as infer returns them
    model: str                  # the model that ran: a breaker's fallback while the one asked for is open
    version: str                # the version that ran: the traffic split's pick when none was named
    traceparent: str | None     # the broker's request span (tracing on), else the one sent, if any


class ConnectError(ConnectionError):
    """No tgw broker answered at the address (or the address or server key is unusable)."""


def server_public_key(value: str | bytes) -> bytes:
    """A broker's CURVE public key from its z85 text (40 characters) or its `.key` certificate file."""
    text = value.decode() if isinstance(value, bytes) else str(value)
    if os.path.isfile(text):
        try:
            return zmq.auth.load_certificate(text)[0]
        except (OSError, ValueError) as exc:
            raise ConnectError(f"cannot read the server key file {text}: {exc}") from None
    text = text.strip()
    if len(text) == 40:
        try:
            z85.decode(text)
            return text.encode()
        except (ValueError, KeyError, IndexError):
            pass
    raise ConnectError(f"server key {text[:60]!r} is neither a 40-character z85 CURVE public key nor an "
                       "existing certificate file (the broker's .key file from `tgw-broker keygen`)")


class Client:
    def __init__(self, address: str | None = None, *, token: str | None = None,
                 server_key: str | bytes | None = None, connect_timeout: float = CONNECT_TIMEOUT_S):
        """`token`: the broker's shared token (default $TGW_TOKEN); `server_key`: the broker's
        CURVE public key, z85 text or its .key file (default $TGW_SERVER_KEY)."""
        self.address = address or default_address()
        self.connect_timeout = connect_timeout
        self.token = token if token is not None else (os.environ.get("TGW_TOKEN", "").strip() or None)
        self.tenant = os.environ.get("TGW_TENANT", "").strip() or None  # infer(tenant=) overrides it
        if server_key is None:
            server_key = os.environ.get("TGW_SERVER_KEY") or None
        self._server_key = server_public_key(server_key) if server_key else None
        if self.address.startswith("tcp://") and self._server_key is None:
            raise ConnectError(f"{self.address}: a tcp:// broker only speaks CURVE; pass server_key= or set "
                               "TGW_SERVER_KEY to the broker's public key (its .key file or the z85 text)")
        self._curve = zmq.curve_keypair() if self._server_key else None  # ephemeral: any key pair will do
        self._ctx = zmq.Context()
        self._local = threading.local()
        self._sockets: list[zmq.Socket] = []
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pid = os.getpid()
        self._closed = False
        self.server: str | None = None
        self.max_request_bytes = 1 << 62  # the broker's, from its hello reply
        try:
            self._socket()  # connect and handshake now: a wrong address, protocol or token fails here
        except BaseException:
            self.close()
            raise

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
              compress: bool = False, tenant: str | None = None, routing_key: str | None = None,
              traceparent: str | None = None) -> dict[str, "np.ndarray"]:  # noqa: F821
        """Run `model` on `inputs` (name -> array with a leading batch dim); returns name -> array.

        `timeout` is in seconds (the model's configured timeout when None; 0 = already expired;
        negative is INVALID_ARGUMENT, as the broker rules); `compress` sends and receives
        lz4-compressed tensors (worth it for large, compressible tensors over tcp); `priority`
        0 is served first (the model's levels: 0..priority_levels-1); `tenant` names whose quota
        the request counts against (default: $TGW_TENANT, else the broker's default tenant);
        `routing_key`, with no version named, keeps the requests that share it on one version
        while a canary split is in place (e.g. a user id); `traceparent` (a W3C trace context,
        "00-<trace id>-<span id>-<flags>") makes the broker's spans children of your span
        (infer_with_meta returns the one that comes back)."""
        if timeout is not None and not timeout >= 0:
            raise fail(Code.INVALID_ARGUMENT, f"timeout must be >= 0 seconds, got {timeout}", timeout=timeout)
        metas, frames, declared, sent = encode_tensors(inputs, compress)
        self._check_size(declared, sent)
        req = Infer(v=PROTOCOL_VERSION, id=next(self._ids), model=model, version=version, inputs=metas,
                    outputs=outputs, priority=priority, compress_outputs=compress,
                    timeout_ms=None if timeout is None else math.ceil(timeout * 1000), token=self.token,
                    tenant=tenant if tenant is not None else self.tenant, routing_key=routing_key,
                    traceparent=traceparent)
        wait = NO_TIMEOUT_WAIT_S if timeout is None else timeout + REPLY_GRACE_S
        reply, tensor_frames = self._call(req, frames, wait, nbytes=sent)
        self._local.reply = reply   # for infer_with_meta (this thread's last answer)
        return decode_outputs(reply.outputs, tensor_frames)

    def infer_with_meta(self, model: str, inputs: dict[str, Any], **options) -> InferResult:
        """As infer (the same options), with what the broker says about the run: the model and
        version that ran, and the traceparent that came back (the broker's request span when
        it traces, else your own; None when you sent none and it does not trace)."""
        outputs = self.infer(model, inputs, **options)
        reply = self._local.reply
        return InferResult(outputs, reply.model, reply.version, reply.traceparent)

    def models(self) -> list[dict]:
        reply, _ = self._call(ListModels(v=PROTOCOL_VERSION, id=next(self._ids), token=self.token), [],
                              self.connect_timeout)
        return [_model_dict(m) for m in reply.models]

    def metadata(self, model: str | None = None) -> list[dict]:
        """Each model's (or one's) versions as served now: state, weight, bytes, loads, evictions,
        and what each worker holds (`tgw-broker models metadata`)."""
        r, _ = self._call(Metadata(v=PROTOCOL_VERSION, id=next(self._ids), model=model, token=self.token), [],
                          self.connect_timeout)
        return [as_builtins(m) for m in r.models]

    def health(self) -> dict:
        r, _ = self._call(Health(v=PROTOCOL_VERSION, id=next(self._ids), token=self.token), [], self.connect_timeout)
        return {"live": r.live, "ready": r.ready, "models": dict(r.models), "workers": dict(r.workers)}

    def stats(self) -> dict:
        r, _ = self._call(Stats(v=PROTOCOL_VERSION, id=next(self._ids), token=self.token), [], self.connect_timeout)
        return {"models": r.models, "processes": r.processes, "errors": r.errors, "refused": r.refused,
                "dropped": r.dropped, "clients": r.clients, "tenants": r.tenants}

    def status(self) -> dict:
        """What `tgw-broker status` shows: phase, uptime, workers (heartbeat figures, restarts,
        last death, crash-loop), models with their queues."""
        r, _ = self._call(Status(v=PROTOCOL_VERSION, id=next(self._ids), token=self.token), [], self.connect_timeout)
        return {"phase": r.phase, "uptime_s": r.uptime_s, "workers": r.workers, "models": r.models,
                "snapshots": r.snapshots, "reload": r.reload, "events": r.events, "http": r.http}

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
            if self._curve:
                sock.curve_publickey, sock.curve_secretkey = self._curve
                sock.curve_serverkey = self._server_key
            sock.connect(self.address)
            self._sockets.append(sock)
        try:
            reply, _ = self._call(Hello(v=PROTOCOL_VERSION, id=next(self._ids), client="tgw.client/py",
                                        token=self.token), [], self.connect_timeout, sock=sock)
        except BaseException as exc:  # a socket that failed its hello is not used again
            with self._lock:
                if sock in self._sockets:
                    self._sockets.remove(sock)
                    sock.close(linger=0)
            if not isinstance(exc, TimeoutError):
                raise
            hint = " (a wrong server key looks the same: check TGW_SERVER_KEY)" if self._curve else ""
            raise ConnectError(f"no tgw broker answered at {self.address} within "
                               f"{self.connect_timeout:g}s{hint}") from None
        self._local.sock = sock
        self.server, self.max_request_bytes = reply.server, reply.max_request_bytes
        return sock

    def _check_size(self, declared: int, sent: int) -> None:
        """The broker's size rule, applied before sending (`declared`: the tensors' raw bytes, `sent`:
        the bytes of their frames): a frame over it would not be read at all (the broker drops such
        a connection unread), so the caller would only see a timeout."""
        if max(declared, sent) > self.max_request_bytes:
            raise fail(Code.PAYLOAD_TOO_LARGE, f"request carries {max(declared, sent)} bytes of tensors; the "
                       f"broker's limit is {self.max_request_bytes} (server.max_request_bytes)",
                       limit=self.max_request_bytes)

    def _call(self, msg, frames: list, wait_s: float, sock: zmq.Socket | None = None, nbytes: int | None = None):
        """Send msg and its tensor frames (`nbytes` in all, when the caller knows), wait for the reply."""
        sock = sock or self._socket()
        copy = (sum(len(f) for f in frames) if nbytes is None else nbytes) < ZERO_COPY_MIN
        send = sock.send
        if frames:  # one multipart message: SNDMORE on every part but the last
            send(encode(msg), SNDMORE, copy=copy)
            for f in frames[:-1]:
                send(f, SNDMORE, copy=copy)
            send(frames[-1], 0, copy=copy)
        else:
            send(encode(msg), 0, copy=copy)
        deadline = time.monotonic() + wait_s
        ready = [(sock, POLLIN)]
        while True:
            # stale replies to abandoned requests must not extend this request's wait
            if sock.closed:
                raise zmq.ZMQError(ENOTSUP)  # as Socket.poll does
            if not zmq.zmq_poll(ready, max(0, int((deadline - time.monotonic()) * 1000))):
                if isinstance(msg, Hello):
                    raise TimeoutError
                # source: the caller gave up waiting (the broker's own DEADLINE_EXCEEDED has none)
                raise fail(Code.DEADLINE_EXCEEDED, f"no reply from {self.address} within {wait_s:.1f}s",
                           request_id=msg.id, source="client")
            # pyzmq sets each frame's `more` as it receives it (recv_multipart asks the socket again)
            frame = sock.recv(copy=False)
            parts = [frame]
            while frame.more:
                frame = sock.recv(copy=False)
                parts.append(frame)
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
