"""The front socket's gate, on a thread of its own: counts connections (monitor events) and
answers libzmq's ZAP request for every new one.

A connection holds a descriptor from accept() until its handshake is answered, so the answer
must not wait behind the event loop (a burst of batches, a busy machine): a flood of
connections would then pile up descriptors until accept() fails with EMFILE, on which libzmq
aborts the process. The thread only reads and bumps the counters in `Callers` (plain ints
under the GIL); the loop reads them.
"""
from __future__ import annotations

import logging
import threading

import zmq

from .callers import Callers

log = logging.getLogger("tgw.broker")
POLL_MS = 200  # how often the thread looks at its stop flag


class Gatekeeper(threading.Thread):
    def __init__(self, callers: Callers, monitor: zmq.Socket, zap: zmq.Socket | None):
        super().__init__(name="tgw-gatekeeper", daemon=True)
        # both sockets are used by this thread only from start() on (thread start is the barrier
        # ZeroMQ asks for when a socket changes threads)
        self.callers, self.monitor, self.zap = callers, monitor, zap
        self._stop_flag = threading.Event()

    def run(self) -> None:
        poller = zmq.Poller()
        for sock in (self.monitor, self.zap):
            if sock is not None:
                poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop_flag.is_set():
                for sock, _ in poller.poll(POLL_MS):
                    # every monitor event first: a connection's ACCEPTED is queued before its ZAP
                    # request, and answering on a count that lacks it lets one past the headroom
                    self._count_connections()
                    if sock is self.zap:
                        self._answer(self.zap.recv_multipart())
        except zmq.ZMQError as exc:  # the context went away under us: the broker is stopping
            if not self._stop_flag.is_set():
                log.error("gatekeeper stopped: %s", exc)
        finally:
            for sock in (self.monitor, self.zap):
                if sock is not None:
                    sock.close(linger=0)

    def _count_connections(self) -> None:
        while True:
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._guarded("monitor", self.callers.on_monitor, frames)

    def _answer(self, frames: list) -> None:
        self._guarded("ZAP", lambda f: self.zap.send_multipart(self.callers.zap(f)), frames)

    @staticmethod
    def _guarded(kind: str, handle, frames: list) -> None:
        try:
            handle(frames)
        except zmq.ZMQError:
            raise
        except Exception:  # one odd message must not end the gate: new connections would hang
            log.exception("gatekeeper: a %s message failed; going on", kind)

    def stop(self) -> None:
        self._stop_flag.set()
        self.join(2 * POLL_MS / 1000 + 1)
