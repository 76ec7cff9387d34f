"""A minimal synchronous caller on the native socket that can send its tensors through a
shared-memory region (docs/PROTOCOL.md 5.9): one DEALER socket per thread, `infer` with or
without a region. tests/process/test_regions.py drives the regions through it (the region
benchmark that used it is retired: bench/results/RETIRED.md)."""
from __future__ import annotations

import itertools
import threading
import time

import zmq

from tgw.client.regions import Region
from tgw.client.request import prepare
from tgw.shm.errors import error_from_body, fail, Code
from tgw.shm.wire import ErrorReply, encode, reply_decoder


class Caller:
    """A minimal synchronous caller: one DEALER socket per thread, infer with or without a region."""

    def __init__(self, address: str, token: str | None = None):
        self.address, self.token = address, token
        self.ctx = zmq.Context()
        self.local = threading.local()
        self.ids = itertools.count(1)
        self.lock = threading.Lock()
        self.socks: list = []

    def sock(self) -> zmq.Socket:
        s = getattr(self.local, "sock", None)
        if s is None:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(self.address)
            with self.lock:
                self.socks.append(s)
            self.local.sock = s
        return s

    def call(self, msg, frames=(), timeout: float = 60.0):
        """(reply, tensor frames); an error reply raises its TgwError."""
        reply, parts = self.exchange(msg, frames, timeout)
        if isinstance(reply, ErrorReply):
            raise error_from_body(reply.error)
        return reply, parts

    def exchange(self, msg, frames=(), timeout: float = 60.0):
        """(reply, tensor frames), the reply an ErrorReply too; no reply in time: DEADLINE_EXCEEDED."""
        s = self.sock()
        s.send_multipart([encode(msg), *frames], copy=False)
        deadline = time.monotonic() + timeout
        while True:
            if not s.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                raise fail(Code.DEADLINE_EXCEEDED, f"no reply within {timeout}s", source="client")
            parts = s.recv_multipart(copy=False)
            reply = reply_decoder.decode(parts[0].buffer)
            if reply.id != msg.id:
                continue
            return reply, parts[1:]

    def send(self, msg):
        """Region's `send`: sets the request's id and token, returns the reply."""
        msg.id, msg.token = next(self.ids), self.token
        return self.call(msg)[0]

    def region(self, nbytes: int, **options) -> Region:
        return Region(self.send, nbytes, **options)

    def infer(self, model: str, inputs: dict, region: Region | None = None, timeout: float = 60.0, **options):
        call = prepare(next(self.ids), model, inputs, token=self.token, default_tenant=None, address=self.address,
                       region=region, timeout=timeout, **options)
        answered = False
        try:
            reply, frames = self.exchange(call.msg, call.frames, timeout + 1.0)
            answered = True     # any reply: the broker will not write the call's output slice again
            if isinstance(reply, ErrorReply):
                raise error_from_body(reply.error)
            return call.outputs(reply, frames)
        finally:
            if call.slots is not None:
                region.release(call.slots, answered)
                call.slots = None

    def close(self) -> None:
        for s in self.socks:
            s.close(linger=0)
        self.ctx.term()
