"""A client socket that knows whether its broker is there (docs/PROTOCOL.md section 6b).

Each DEALER socket gets a monitor (an inproc PAIR) that reports the ZMTP handshake and the
disconnect of its one connection, and ZeroMQ heartbeats (PING every `liveness / 4`, the
connection closed when nothing came back `3/4 liveness` after one; TTL asks the broker to close
ours likewise). A broker that dies, restarts or stops answering thus shows as a disconnect within
`liveness` seconds (at once when its process ends: the kernel closes the socket), and the
calls waiting on that connection fail with UNAVAILABLE instead of waiting out their timeout.
ZMQ_IMMEDIATE keeps requests from queueing for a connection that is not up: a send then
fails at once, and the caller waits for the handshake, bounded by liveness and its deadline.
"""
from __future__ import annotations

import select
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from tgw.shm.errors import Code, TgwError, fail

LIVENESS_S = 5.0
UP, DOWN = zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_DISCONNECTED
POLLIN, EVENTS = int(zmq.POLLIN), int(zmq.EVENTS)


class Link:
    """One DEALER socket, its monitor, and the state of its connection."""

    def __init__(self, ctx: zmq.Context, address: str, liveness: float | None, curve=None, server_key=None,
                 unbounded: bool = False):
        """`curve`: the client's (public, secret) key pair when `server_key` is set; `unbounded`:
        no high-water marks (an async client keeps thousands of requests in flight)."""
        self.address, self.liveness = address, liveness
        sock = self.sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        if unbounded:
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
        if liveness:
            # a silence is noticed a PING interval plus the timeout after it began: within liveness
            ms = max(100, int(liveness * 1000))
            sock.setsockopt(zmq.HEARTBEAT_IVL, ms // 4)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ms - ms // 4)
            sock.setsockopt(zmq.HEARTBEAT_TTL, min(ms, 6553500))
        if curve:
            sock.curve_publickey, sock.curve_secretkey = curve
            sock.curve_serverkey = server_key
        self.monitor = sock.get_monitor_socket(UP | DOWN)
        # both sockets' ZMQ_FDs: one poll() syscall per wait, where zmq_poll makes several
        self._fds = select.poll()
        self._fds.register(sock.getsockopt(zmq.FD), select.POLLIN)
        self._fds.register(self.monitor.getsockopt(zmq.FD), select.POLLIN)
        self.up = False
        self.losses = 0          # disconnects seen: a call made before one cannot be answered
        self.max_inflight: int | None = None   # the broker's per-caller cap, from its hello (None: none said)
        try:
            sock.connect(address)
        except BaseException:    # an open socket would keep its context's term() waiting forever
            self.close()
            raise

    def events(self) -> bool:
        """Apply the monitor's queued events; True when a disconnect was among them."""
        lost = False
        monitor = self.monitor
        while monitor.getsockopt(EVENTS) & POLLIN:
            event = parse_monitor_message(monitor.recv_multipart())["event"]
            if event == UP:
                self.up = True
            elif event == DOWN:
                self.up = False
                self.losses += 1
                lost = True
        return lost

    def lost_error(self, request_id: int | None = None) -> TgwError:
        return fail(Code.UNAVAILABLE, f"the connection to the broker at {self.address} was lost (it died, "
                    f"restarted or stopped answering heartbeats for {self.liveness:g}s); the request may or may "
                    "not have run", source="client", request_id=request_id)

    def down_error(self, waited: float) -> TgwError:
        return fail(Code.UNAVAILABLE, f"no connection to the broker at {self.address} came up within {waited:.1f}s",
                    source="client", waited_s=round(waited, 3))

    def wait(self, ms: int) -> bool:
        """Block until the socket or its monitor may have news (True) or `ms` passed (False).
        Only once both were last asked for EVENTS with nothing to read: a ZMQ_FD signals news
        that came after that, and nothing before."""
        return bool(self._fds.poll(ms))

    def wait_up(self, seconds: float) -> bool:
        """Block until the connection is up (True) or `seconds` passed (False)."""
        self.events()
        if self.up:
            return True
        poller = [(self.monitor, POLLIN)]
        end = time.monotonic() + seconds
        while not self.up:
            left = end - time.monotonic()
            if left <= 0 or not zmq.zmq_poll(poller, int(left * 1000) + 1):
                return self.up
            self.events()
        return True

    def close(self, linger_ms: int = 0) -> None:
        """`linger_ms`: how long a last message (a goodbye) may still go out."""
        if not self.sock.closed:
            self.sock.disable_monitor()
            self.sock.close(linger=linger_ms)
        self.monitor.close(linger=0)


def is_lost(err: BaseException) -> bool:
    return isinstance(err, TgwError) and err.code is Code.UNAVAILABLE
