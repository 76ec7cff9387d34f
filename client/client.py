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
import os
import threading
import time
from typing import Any, NamedTuple

import zmq
import zmq.auth
from zmq.utils import z85

from tgw.shm.errors import Code, error_from_body, fail
from tgw.shm.paths import default_address, ipc_path
from tgw.shm.wire import PROTOCOL_VERSION, DecodeError, ErrorReply, Goodbye, Health, Hello, ListModels, Metadata, \
    Stats, Status, as_builtins, encode, reply_decoder

from .connection import LIVENESS_S, Link
from .request import Call, prepare
from .retry import REREGISTER, Attempts, RetryPolicy
from .tensors import ZERO_COPY_MIN

CONNECT_TIMEOUT_S = 5.0
GOODBYE_LINGER_MS = 100  # how long close() lets the goodbye go out
# plain ints: pyzmq's enum flags cost an enum operation per use, and its send_multipart,
# recv_multipart and Socket.poll helpers several (Python-level option lookups, a Poller per
# call), which is most of what this client spends per call besides the socket itself
SNDMORE, POLLIN, ENOTSUP = int(zmq.SNDMORE), int(zmq.POLLIN), int(zmq.ENOTSUP)
NOBLOCK, EVENTS = int(zmq.NOBLOCK), int(zmq.EVENTS)
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


def settings(address: str | None, token: str | None, server_key: str | bytes | None) -> tuple:
    """(address, token, tenant, server key, the client's CURVE key pair) from the arguments and
    the environment ($TGW_ADDRESS by way of default_address, $TGW_TOKEN, $TGW_TENANT,
    $TGW_SERVER_KEY); raises ConnectError for a tcp:// address without a server key."""
    address = address or default_address()
    token = token if token is not None else (os.environ.get("TGW_TOKEN", "").strip() or None)
    tenant = os.environ.get("TGW_TENANT", "").strip() or None  # infer(tenant=) overrides it
    if server_key is None:
        server_key = os.environ.get("TGW_SERVER_KEY") or None
    key = server_public_key(server_key) if server_key else None
    if address.startswith("tcp://") and key is None:
        raise ConnectError(f"{address}: a tcp:// broker only speaks CURVE; pass server_key= or set "
                           "TGW_SERVER_KEY to the broker's public key (its .key file or the z85 text)")
    curve = zmq.curve_keypair() if key else None  # ephemeral: any key pair will do
    return address, token, tenant, key, curve


class Client:
    def __init__(self, address: str | None = None, *, token: str | None = None,
                 server_key: str | bytes | None = None, connect_timeout: float = CONNECT_TIMEOUT_S,
                 liveness: float | None = LIVENESS_S, retry: RetryPolicy | None = None):
        """`token`: the broker's shared token (default $TGW_TOKEN); `server_key`: the broker's
        CURVE public key, z85 text or its .key file (default $TGW_SERVER_KEY); `liveness`:
        seconds within which a dead, restarted or silent broker is noticed and the calls waiting
        on it raise UnavailableError (None: only when its process ends); `retry`: the policy
        every infer call uses unless it passes its own (default: no retries)."""
        self.connect_timeout, self.liveness, self.retry = connect_timeout, liveness, retry
        self.address, self.token, self.tenant, self._server_key, self._curve = settings(address, token, server_key)
        self._ctx = zmq.Context()
        self._local = threading.local()
        self._links: list[Link] = []
        self._regions: list = []
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pid = os.getpid()
        self._closed = False
        self.server: str | None = None
        self.max_request_bytes = 1 << 62  # the broker's, from its hello reply
        try:
            self._link()  # connect and handshake now: a wrong address, protocol or token fails here
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Unregister this client's regions, tell the broker goodbye (it drops what this client
        still has queued) and close every thread's socket; call once those threads are done."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            regions, self._regions = self._regions, []
        for region in regions:
            region.close()
        with self._lock:
            for link in self._links:
                link.events()
                if link.up:  # best effort: a broker that is gone needs no goodbye
                    try:
                        link.sock.send(encode(Goodbye(v=PROTOCOL_VERSION, token=self.token)), NOBLOCK)
                    except zmq.ZMQError:
                        pass
                link.close(GOODBYE_LINGER_MS if link.up else 0)
            self._links.clear()
        self._ctx.term()

    # ---- public calls ------------------------------------------------------------------------

    def infer(self, model: str, inputs: dict[str, Any], *, version: str | None = None,
              timeout: float | None = None, outputs: list[str] | None = None, priority: int = 0,
              compress: bool | str = False, tenant: str | None = None, routing_key: str | None = None,
              traceparent: str | None = None, return_type: str = "numpy", region=None,
              retry: RetryPolicy | None = None, **options) -> dict[str, Any]:
        """Run `model` on `inputs` (name -> numpy array or torch tensor, leading batch dim);
        returns name -> numpy array (torch tensors with `return_type="torch"`).

        `timeout` is in seconds (the model's configured timeout when None; 0 = already expired;
        negative is INVALID_ARGUMENT, as the broker rules); `compress`: True lz4-compresses every
        tensor both ways, "auto" only those large and compressible enough (README: Compression);
        `priority` 0 is served first (the model's levels: 0..priority_levels-1); `tenant` names
        whose quota the request counts against (default: $TGW_TENANT, else the broker's default
        tenant); `routing_key`, with no version named, keeps the requests that share it on one
        version while a canary split is in place (e.g. a user id); `traceparent` (a W3C trace
        context, "00-<trace id>-<span id>-<flags>") makes the broker's spans children of your
        span (infer_with_meta returns the one that comes back); `region` (from `self.region()`)
        carries large tensors through shared memory instead of the socket; `retry` overrides the
        client's retry policy. Further options (`wire_dtype`, `cuda_out`) are described in the
        README's client section."""
        tries = Attempts(retry if retry is not None else self.retry, timeout, region)
        while True:
            call = prepare(next(self._ids), model, inputs, token=self.token, default_tenant=self.tenant,
                           address=self.address, version=version, timeout=tries.left(), outputs=outputs,
                           priority=priority, compress=compress, tenant=tenant, routing_key=routing_key,
                           traceparent=traceparent, return_type=return_type, region=region, **options)
            try:
                reply, frames = self._infer(call)
                self._local.reply = reply   # for infer_with_meta (this thread's last answer)
                return call.outputs(reply, frames)
            except Exception as exc:
                call.end(exc)
                wait = tries.after(exc)
                if wait is None:
                    raise
            finally:
                call.end()
            if wait is REREGISTER:   # the broker restarted
                region.reregister()
            else:
                time.sleep(wait)     # the policy's back-off, before the next try

    def infer_with_meta(self, model: str, inputs: dict[str, Any], **options) -> InferResult:
        """As infer (the same options), with what the broker says about the run: the model and
        version that ran, and the traceparent that came back (the broker's request span when
        it traces, else your own; None when you sent none and it does not trace)."""
        outputs = self.infer(model, inputs, **options)
        reply = self._local.reply
        return InferResult(outputs, reply.model, reply.version, reply.traceparent)

    def stream(self, model: str, *, window: int = 64, **options):
        """A streaming session on a socket of its own: send many requests, take their results as
        they complete (tagged, possibly out of order), at most `window` outstanding; `options`
        are infer's, for every request of the session. See client.stream.Stream."""
        from .stream import Stream
        return Stream(self, model, window, options)

    def region(self, nbytes: int, **options):
        """Register a shared-memory region of `nbytes` with the broker (same host, same uid):
        pass it as `infer(..., region=r)` and tensors above its threshold travel through it, not
        the socket. Unregistered by `r.close()` or this client's close. See client.regions."""
        from .regions import Region
        region = Region(self._control_call, nbytes, **options)
        with self._lock:
            self._regions.append(region)
        return region

    def models(self) -> list[dict]:
        return [model_dict(m) for m in self._control_call(ListModels(v=PROTOCOL_VERSION)).models]

    def metadata(self, model: str | None = None) -> list[dict]:
        """Each model's (or one's) versions as served now: state, weight, bytes, loads, evictions,
        and what each worker holds (`tgw-broker models metadata`)."""
        return [as_builtins(m) for m in self._control_call(Metadata(v=PROTOCOL_VERSION, model=model)).models]

    def health(self) -> dict:
        return health_dict(self._control_call(Health(v=PROTOCOL_VERSION)))

    def stats(self) -> dict:
        return stats_dict(self._control_call(Stats(v=PROTOCOL_VERSION)))

    def status(self) -> dict:
        """What `tgw-broker status` shows: phase, uptime, workers (heartbeat figures, restarts,
        last death, crash-loop), models with their queues."""
        return status_dict(self._control_call(Status(v=PROTOCOL_VERSION)))

    # ---- plumbing ----------------------------------------------------------------------------

    def next_id(self) -> int:
        return next(self._ids)

    def _control_call(self, msg, timeout: float | None = None):
        """A request that is not an infer, given its id and token here; answered in connect_timeout."""
        msg.id, msg.token = next(self._ids), self.token
        return self._call(msg, [], timeout or self.connect_timeout)[0]

    def _infer(self, call: Call):
        self._check_size(call.declared, call.sent)
        wait = NO_TIMEOUT_WAIT_S if call.timeout is None else call.timeout + REPLY_GRACE_S
        return self._call(call.msg, call.frames, wait, nbytes=call.sent)

    def new_link(self, unbounded: bool = False) -> Link:
        """A connected socket with its monitor, the handshake done (a stream has one of its own)."""
        if os.getpid() != self._pid:
            raise RuntimeError("tgw Client used after fork; create a Client in each process")
        with self._lock:
            if self._closed:
                raise RuntimeError("tgw Client is closed")
            path = ipc_path(self.address)
            if path is not None and not os.path.exists(path):
                raise ConnectError(f"no tgw broker at {self.address}: {path} does not exist")
            link = Link(self._ctx, self.address, self.liveness, self._curve, self._server_key, unbounded)
            self._links.append(link)
        try:
            if not link.wait_up(self.connect_timeout):
                raise TimeoutError
            reply, _ = self._call(Hello(v=PROTOCOL_VERSION, id=next(self._ids), client="tgw.client/py",
                                        token=self.token), [], self.connect_timeout, link=link)
        except BaseException as exc:  # a socket that failed its hello is not used again
            self.drop_link(link)
            if not isinstance(exc, TimeoutError):
                raise
            hint = " (a wrong server key looks the same: check TGW_SERVER_KEY)" if self._curve else ""
            raise ConnectError(f"no tgw broker answered at {self.address} within "
                               f"{self.connect_timeout:g}s{hint}") from None
        self.server, self.max_request_bytes = reply.server, reply.max_request_bytes
        return link

    def late_reply(self, req_id: int) -> None:
        """A reply came for a call that gave up: what its regions kept for it may be reused."""
        for region in self._regions:
            region.late_reply(req_id)

    def drop_link(self, link: Link) -> None:
        with self._lock:
            if link in self._links:
                self._links.remove(link)
                link.close()

    def _link(self) -> Link:
        link = getattr(self._local, "link", None)
        if link is None:
            link = self._local.link = self.new_link()
        return link

    def _check_size(self, declared: int, sent: int) -> None:
        """The broker's size rule, applied before sending (`declared`: the tensors' raw bytes, `sent`:
        the bytes of their frames): a frame over it would not be read at all (the broker drops such
        a connection unread), so the caller would only see a timeout."""
        if max(declared, sent) > self.max_request_bytes:
            raise fail(Code.PAYLOAD_TOO_LARGE, f"request carries {max(declared, sent)} bytes of tensors; the "
                       f"broker's limit is {self.max_request_bytes} (server.max_request_bytes)",
                       limit=self.max_request_bytes)

    def send(self, link: Link, msg, frames: list, wait_s: float, nbytes: int | None = None) -> None:
        """Send msg and its tensor frames (`nbytes` in all, when the caller knows) once the
        connection is up, waiting for it at most min(liveness, wait_s)."""
        copy = (sum(len(f) for f in frames) if nbytes is None else nbytes) < ZERO_COPY_MIN
        send, header = link.sock.send, encode(msg)
        link.events()
        for _ in range(2):
            try:  # one multipart message: SNDMORE on every part but the last; the first part
                if frames:  # fails alone (nothing queued) while no connection is up
                    send(header, SNDMORE | NOBLOCK, copy=copy)
                    for f in frames[:-1]:
                        send(f, SNDMORE, copy=copy)
                    send(frames[-1], 0, copy=copy)
                else:
                    send(header, NOBLOCK, copy=copy)
                return
            except zmq.Again:
                waited = min(wait_s, self.liveness or wait_s)
                if not link.wait_up(waited):
                    raise link.down_error(waited) from None

    def _call(self, msg, frames: list, wait_s: float, link: Link | None = None, nbytes: int | None = None):
        """Send msg and its tensor frames, wait for the reply (or the connection's loss)."""
        link = link or self._link()
        self.send(link, msg, frames, wait_s, nbytes)
        losses, sock = link.losses, link.sock
        deadline = time.monotonic() + wait_s
        ready = [(sock, POLLIN), (link.monitor, POLLIN)]
        while True:
            # stale replies to abandoned requests must not extend this request's wait
            if sock.closed:
                raise zmq.ZMQError(ENOTSUP)  # as Socket.poll does
            if not sock.getsockopt(EVENTS) & POLLIN:
                if link.events() or link.losses != losses:
                    raise link.lost_error(msg.id)
                if not zmq.zmq_poll(ready, max(0, int((deadline - time.monotonic()) * 1000))):
                    if isinstance(msg, Hello):
                        raise TimeoutError
                    # source: the caller gave up waiting (the broker's own DEADLINE_EXCEEDED has none)
                    raise fail(Code.DEADLINE_EXCEEDED, f"no reply from {self.address} within {wait_s:.1f}s",
                               request_id=msg.id, source="client")
                continue
            reply, parts = read_reply(sock)
            if reply.id != msg.id:
                self.late_reply(reply.id)
                continue  # a late answer to an earlier request this thread gave up on
            if isinstance(reply, ErrorReply):
                raise error_from_body(reply.error)
            return reply, parts


def read_reply(sock: zmq.Socket):
    """One reply waiting on `sock`: its decoded header and its tensor frames."""
    # pyzmq sets each frame's `more` as it receives it (recv_multipart asks the socket again)
    frame = sock.recv(copy=False)
    parts = [frame]
    while frame.more:
        frame = sock.recv(copy=False)
        parts.append(frame)
    try:
        return reply_decoder.decode(parts[0].buffer), parts[1:]
    except DecodeError as exc:
        raise fail(Code.INTERNAL, f"undecodable reply from broker: {exc}") from None


def model_dict(m) -> dict:
    io = lambda ts: [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in ts]  # noqa: E731
    return {"name": m.name, "versions": list(m.versions), "default_version": m.default_version,
            "max_batch_size": m.max_batch_size, "inputs": io(m.inputs), "outputs": io(m.outputs),
            "ready": m.ready, "wire_dtypes": list(m.wire_dtypes)}


def health_dict(r) -> dict:
    return {"live": r.live, "ready": r.ready, "models": dict(r.models), "workers": dict(r.workers)}


def stats_dict(r) -> dict:
    return {"models": r.models, "processes": r.processes, "errors": r.errors, "refused": r.refused,
            "dropped": r.dropped, "clients": r.clients, "tenants": r.tenants, "abandoned": r.abandoned,
            "regions": r.regions}


def status_dict(r) -> dict:
    return {"phase": r.phase, "uptime_s": r.uptime_s, "workers": r.workers, "models": r.models,
            "snapshots": r.snapshots, "reload": r.reload, "events": r.events, "http": r.http}
