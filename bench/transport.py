"""The transport floor: raw pyzmq client -> ROUTER broker -> DEALER worker echo over ipc://.

No model, no shared memory, no msgpack: what any design on ZeroMQ + Python pays per request.
The broker drains each socket with NOBLOCK until zmq.Again (as tgw's broker does) and forwards
frames without copying; the worker replies with as many bytes as the 8-byte header asks for
(the model's output size). Run as `python -m tgw.bench.transport broker FRONT BACK | worker BACK`.
"""
from __future__ import annotations

import os
import signal
import struct
import sys

import zmq

from tgw.bench.broker_proc import Proc


def _stop_on_sigterm() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))


def _drain(src, dst, nmax: int = 256) -> None:
    for _ in range(nmax):
        try:
            frames = src.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        dst.send_multipart(frames, copy=False)


def run_broker(front_addr: str, back_addr: str) -> None:
    _stop_on_sigterm()
    ctx = zmq.Context()
    front, back = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    for s in (front, back):
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 0)
    front.bind(front_addr)
    back.bind(back_addr)
    poller = zmq.Poller()
    poller.register(front, zmq.POLLIN)
    poller.register(back, zmq.POLLIN)
    try:
        while True:
            for sock, _ in poller.poll():
                _drain(sock, back if sock is front else front)
    finally:
        front.close(0)
        back.close(0)
        ctx.term()


def run_worker(back_addr: str) -> None:
    _stop_on_sigterm()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(back_addr)
    replies: dict[int, bytes] = {}
    try:
        while True:
            ident, header, _payload = sock.recv_multipart(copy=False)
            n = struct.unpack("<Q", header.bytes)[0]
            if n not in replies:
                replies[n] = bytes(n)
            sock.send_multipart([ident, replies[n]], copy=False)
    finally:
        sock.close(0)
        ctx.term()


class EchoServer:
    """The echo broker and one worker as subprocesses in `workdir`; stop() stops both by PID."""

    def __init__(self, workdir: str):
        self.front = f"ipc://{workdir}/echo-front.sock"
        back = f"ipc://{workdir}/echo-back.sock"
        py = [sys.executable, "-m", "tgw.bench.transport"]
        self.broker = Proc([*py, "broker", self.front, back], os.path.join(workdir, "echo-broker.log"), "echo broker")
        self.worker = Proc([*py, "worker", back], os.path.join(workdir, "echo-worker.log"), "echo worker")
        try:
            self.broker.start()
            self.worker.start()
            self.broker.wait_for(self._ping, 30, "the transport-floor echo")
        except BaseException:
            self.stop()
            raise
        self.processes = [{"role": "broker", "pid": self.broker.pid, "device": "-"},
                          {"role": "worker", "pid": self.worker.pid, "device": "-"}]

    def _ping(self) -> bool:
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        try:
            s.connect(self.front)
            s.send_multipart([struct.pack("<Q", 1), b"x"])
            return bool(s.poll(500)) and s.recv_multipart() == [b"\0"]
        finally:
            s.close(0)

    def stop(self) -> None:
        for p in (self.worker, self.broker):
            p.stop(timeout=5)


def main(argv: list[str]) -> None:
    if argv[:1] == ["broker"] and len(argv) == 3:
        run_broker(argv[1], argv[2])
    elif argv[:1] == ["worker"] and len(argv) == 2:
        run_worker(argv[1])
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
