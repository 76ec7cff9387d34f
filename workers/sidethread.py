"""A worker thread beside the serving loop with a DEALER socket of its own (zmq sockets are one
thread's each) and a wake pipe, so stop() interrupts its poll. The beacon and the loader are two."""
from __future__ import annotations

import logging
import os
import threading

import zmq

log = logging.getLogger("tgw.worker")
SIDE_THREAD_DIED = 70   # the worker's exit status when a side thread raised (EX_SOFTWARE)


class SideThread:
    def __init__(self, ctx: zmq.Context, endpoint: str, identity: bytes, name: str):
        self.sock = ctx.socket(zmq.DEALER)  # used only by the thread from start() on
        self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.setsockopt(zmq.LINGER, 0)  # nothing it sends is worth waiting for once we stop
        self.sock.connect(endpoint)
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC)  # stop() interrupts the poll
        self._stopped = False
        self.thread = threading.Thread(target=self._guarded, name=name, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 5.0) -> bool:
        """End the thread, which closes its socket; False if it is still running after `timeout`.
        Call before the Context is terminated; a second call does nothing."""
        if self._stopped:
            return True
        if self.thread.ident is None:  # never started
            self._close()
        else:
            os.write(self._wake_w, b"x")
            self.thread.join(timeout)
            if self.thread.is_alive():
                return False  # it still polls the pipe: leave it open
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._stopped = True
        return True

    def poller(self) -> zmq.Poller:
        """A poller of the socket and the wake pipe (`woken` tells the pipe's readiness apart)."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        return poller

    def woken(self, ready: dict) -> bool:
        return self._wake_r in ready

    def serve_once(self, poller: zmq.Poller, timeout_ms: int | None = None) -> bool:
        """Wait up to `timeout_ms` (None: for ever) and answer the socket's message if one came;
        False once stop() woke the thread."""
        ready = dict(poller.poll(timeout_ms))
        if self.woken(ready):
            return False
        if self.sock in ready:
            self._answer()
        return True

    def _answer(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        raise NotImplementedError

    def _guarded(self) -> None:
        """A side thread that raises ends the worker: a worker whose loader or beacon is gone
        would hang every load or look hung; its death is seen, its batches retried, a fresh
        worker started."""
        try:
            self._run()
        except BaseException:
            log.critical("worker side thread %s died; the worker exits", self.thread.name, exc_info=True)
            logging.shutdown()
            os._exit(SIDE_THREAD_DIED)

    def _close(self) -> None:
        self.sock.close()
