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
from typing import Any

import zmq

from tgw.shm.errors import Code, error_from_body, fail
from tgw.shm.paths import ipc_path
from tgw.shm.wire import PROTOCOL_VERSION, Cancel, ErrorReply, Health, Hello, Infer, ListModels, Metadata, Stats, \
    Status, as_builtins, encode

from .connection import LIVENESS_S, Link
from .request import Call, prepare
from .results import InferResult, health_dict, model_dict, stats_dict, status_dict
from .retry import REREGISTER, Attempts, RetryPolicy
from .settings import CONNECT_TIMEOUT_S, ConnectError, settings
from .transport import ENOTSUP, EVENTS, GOODBYE_LINGER_MS, NOBLOCK, POLLIN, check_size, read_reply, reply_wait, \
    say_goodbye, send_request
from .transport import REPLY_GRACE_S  # noqa: F401 - read here by bench/harness/openloop.py

IDLE_GEN_LINKS = 8   # sockets of ended generations kept for the next ones (a new one costs a handshake)


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
        self._cancels: dict[int, int] = {}   # id of a cancel sent -> the request it withdraws
        self._idle_gen_links: list[Link] = []   # sockets of ended generations, for the next ones
        self._ranks: dict[str, dict[str, int]] = {}   # model -> its inputs' declared ranks (generate's)
        self._pid = os.getpid()
        self._closed = False
        self.server: str | None = None
        self.max_request_bytes = 1 << 62  # the broker's, from its hello reply
        self.max_inflight_per_client: int | None = None   # the broker's per-connection cap, from its hello
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
                link.close(say_goodbye(link, self.token))
            self._links.clear()
            self._idle_gen_links.clear()
        self._ctx.term()

    # ---- public calls ------------------------------------------------------------------------

    def infer(self, model: str, inputs: dict[str, Any], *, version: str | None = None,
              timeout: float | None = None, outputs: list[str] | None = None, priority: int = 0,
              compress: bool | str = False, tenant: str | None = None, routing_key: str | None = None,
              traceparent: str | None = None, return_type: str = "numpy", region=None,
              retry: RetryPolicy | None = None, sequence_id: int | str | None = None, sequence_start: bool = False,
              sequence_end: bool = False, **options) -> dict[str, Any]:
        """Run `model` on `inputs` (name -> numpy array or torch tensor, leading batch dim);
        returns name -> numpy array (torch tensors with `return_type="torch"`).

        `timeout` is in seconds (the model's configured timeout when None; 0 = already expired;
        negative is INVALID_ARGUMENT, as the broker rules); `compress`: True lz4-compresses every
        tensor both ways, "auto" only those large and compressible enough (docs/CLIENT.md, compression);
        `priority` 0 is served first (the model's levels: 0..priority_levels-1); `tenant` names
        whose quota the request counts against (default: $TGW_TENANT, else the broker's default
        tenant); `routing_key`, with no version named, keeps the requests that share it on one
        version while a canary split is in place (e.g. a user id); `traceparent` (a W3C trace
        context, "00-<trace id>-<span id>-<flags>") makes the broker's spans children of your
        span (infer_with_meta returns the one that comes back); `region` (from `self.region()`)
        carries large tensors through shared memory instead of the socket; `retry` overrides the
        client's retry policy. `sequence_id` (a non-zero uint64 or a non-empty string, as the
        model's sequence_batching.correlation_id says), `sequence_start`, `sequence_end`: a step of
        a sequence model's sequence (docs/SEQUENCES.md), as Triton's clients send them. Further options (`wire_dtype`, `cuda_out`) are described in the
        client guide, docs/CLIENT.md."""
        tries = Attempts(retry if retry is not None else self.retry, timeout, region)
        while True:
            call = prepare(next(self._ids), model, inputs, token=self.token, default_tenant=self.tenant,
                           address=self.address, version=version, timeout=tries.left(), outputs=outputs,
                           priority=priority, compress=compress, tenant=tenant, routing_key=routing_key,
                           traceparent=traceparent, return_type=return_type, region=region,
                           sequence_id=sequence_id, sequence_start=sequence_start, sequence_end=sequence_end,
                           **options)
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

    def generate(self, model: str, inputs: Any, *, max_outputs: int | None = None, sampling=None,
                 seed: int | None = None, version: str | None = None, timeout: float | None = None,
                 priority: int = 0, tenant: str | None = None, routing_key: str | None = None,
                 traceparent: str | None = None):
        """Generate from the generator `model`: an iterator of its outputs as they come - Python
        ints for a generator whose one output is an integer scalar (a token), else dicts name ->
        numpy array of one output - on a socket of its own (read it from one thread at a time).

        `inputs` as infer's, for ONE sequence: each input without the batch dim (a prompt [P]),
        or with a batch dim of 1; a model with one input may be given it alone. `max_outputs`:
        at most that many (default and cap: the model's `generator.max_outputs`); `sampling`: a
        dict of tgw.shm.wire.Sampling's fields (temperature, top_k, top_p, seed, stop_tokens,
        stop_sequences) or a Sampling (default greedy); `seed`: sampling's seed given on its own;
        `timeout`: seconds for the whole generation. The other options are infer's. Once the
        iteration is over, `.final` holds a GenerationEnd (reason, outputs, seed,
        first_output_ms, total_ms, resumed, model, version); an error mid-stream is raised from
        the iteration. `close()` (or leaving a `with` block, or dropping the stream) cancels it."""
        from .gen_stream import Generation
        return Generation(self, model, inputs, max_outputs=max_outputs, sampling=sampling, seed=seed,
                          version=version, timeout=timeout, priority=priority, tenant=tenant,
                          routing_key=routing_key, traceparent=traceparent)

    def submit(self, model: str, inputs: Any, *, generate: dict | None = None, version: str | None = None,
               timeout: float | None = None, outputs: list[str] | None = None, priority: int = 0,
               compress: bool | str = False, tenant: str | None = None, routing_key: str | None = None,
               traceparent: str | None = None):
        """Submit a job (docs/JOBS.md): the broker answers at once with its id and runs it as it
        runs any request; returns a Job to read its status, outputs so far and result from (or
        to cancel). `generate` (a dict of max_outputs, sampling, seed, as generate's) makes it a
        generation, its `inputs` one sequence's; `timeout` bounds the job's run (seconds, from
        its submission; the model's timeout when None). The other options are infer's."""
        from .jobs import Job, submit_call
        ranks = self.input_ranks(model) if generate is not None else None
        call = submit_call(self, ranks, model, inputs, generate,
                           dict(version=version, timeout=timeout, outputs=outputs, priority=priority,
                                compress=compress, tenant=tenant, routing_key=routing_key, traceparent=traceparent))
        check_size(call.declared, call.sent, self.max_request_bytes)
        reply, _ = self._call(call.msg, call.frames, self.connect_timeout, nbytes=call.sent)
        return Job(self, reply.job_id, call.msg.tenant)

    def job(self, job_id: str, *, tenant: str | None = None):
        """The job `job_id` (submitted by this client or any other, to this broker run): a Job.
        `tenant`: the one that submitted it (default: this client's)."""
        from .jobs import Job
        return Job(self, job_id, tenant if tenant is not None else self.tenant)

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

    def _call_frames(self, msg, wait_s: float):
        """A request other than infer, given its id and token here: its reply and frames."""
        msg.id, msg.token = next(self._ids), self.token
        return self._call(msg, [], wait_s)

    def _infer(self, call: Call):
        check_size(call.declared, call.sent, self.max_request_bytes)
        return self._call(call.msg, call.frames, reply_wait(call.timeout), nbytes=call.sent)

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
        self.max_inflight_per_client = link.max_inflight = reply.max_inflight_per_client
        return link

    def input_ranks(self, model: str) -> dict[str, int] | None:
        """The model's inputs' declared ranks (without the batch dim), from `models` (asked once
        per model); None when the broker serves no such model (its answer to the request says so)."""
        ranks = self._ranks.get(model)
        if ranks is None:
            from .gen_stream import declared_ranks
            self._ranks.update(declared_ranks(self._control_call(ListModels(v=PROTOCOL_VERSION)).models))
            ranks = self._ranks.get(model)
        return ranks

    def generation_link(self) -> Link:
        """A socket for one generation: an idle one of an ended generation, else a new one."""
        with self._lock:
            if self._idle_gen_links:
                return self._idle_gen_links.pop()
        return self.new_link()

    def generation_link_done(self, link: Link, reuse: bool) -> None:
        """The generation on `link` is over: `reuse` (the broker ended it) keeps it for the next
        (a few), else it is closed once what was sent went out (a cancel)."""
        with self._lock:
            if reuse and not self._closed and link in self._links and len(self._idle_gen_links) < IDLE_GEN_LINKS:
                self._idle_gen_links.append(link)
                return
        self.drop_link(link, GOODBYE_LINGER_MS)

    def late_reply(self, req_id: int) -> None:
        """A reply came for a call that gave up: what its regions kept for it may be reused. The
        answer to a cancel stands for the request it withdrew: the broker answers that one never."""
        req_id = self._cancels.pop(req_id, req_id)
        for region in self._regions:
            region.late_reply(req_id)

    def _withdraw(self, link: Link, req_id: int) -> None:
        """The call gave up waiting: the broker withdraws the request wherever it still is (queued,
        or taken out of its batch) and answers the cancel instead, later, on this link."""
        cancel_id = next(self._ids)
        try:
            link.sock.send(encode(Cancel(v=PROTOCOL_VERSION, id=cancel_id, ids=[req_id], token=self.token)), NOBLOCK)
        except zmq.ZMQError:   # no connection: the broker that had it is gone anyway
            return
        if len(self._cancels) >= 4096:   # answers a lost connection never brought: forget the oldest
            self._cancels.pop(next(iter(self._cancels)), None)
        self._cancels[cancel_id] = req_id

    def drop_link(self, link: Link, linger_ms: int = 0) -> None:
        with self._lock:
            if link in self._links:
                self._links.remove(link)
                link.close(linger_ms)

    def _link(self) -> Link:
        link = getattr(self._local, "link", None)
        if link is None:
            link = self._local.link = self.new_link()
        return link

    def send(self, link: Link, msg, frames: list, wait_s: float, nbytes: int | None = None) -> None:
        """Send msg and its tensor frames (`nbytes` in all, when the caller knows) once the
        connection is up, waiting for it at most min(liveness, wait_s)."""
        header = encode(msg)
        link.events()
        for _ in range(2):
            try:
                return send_request(link.sock, header, frames, nbytes)
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
        fresh = True   # send() has just drained the monitor: until a wait wakes, its FD tells of anything newer
        while True:
            # stale replies to abandoned requests must not extend this request's wait
            if sock.closed:
                raise zmq.ZMQError(ENOTSUP)  # as Socket.poll does
            if not sock.getsockopt(EVENTS) & POLLIN:
                if (not fresh and link.events()) or link.losses != losses:
                    raise link.lost_error(msg.id)
                fresh = False
                if not link.wait(max(0, int((deadline - time.monotonic()) * 1000))):
                    if isinstance(msg, Hello):
                        raise TimeoutError
                    if isinstance(msg, Infer):
                        self._withdraw(link, msg.id)
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

