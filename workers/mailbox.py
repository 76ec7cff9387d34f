"""The serving loop's socket to the broker, and the messages read ahead of their turn.

While a batch waits for output space the worker must read on (a release may be coming); what it
reads meanwhile is parked here and taken, in order, before the socket is read again.

Withdrawals (the broker's Withdraw: nobody waits for some requests of a batch any more) are
noted the moment they are read, wherever that happens, for batches not yet launched; a batch
about to launch first reads what is already waiting on the socket (look_ahead), so one sent
while the batch waited behind another still reaches it. The completions of a batch that was
shrunk say which requests it left out (Done.withdrawn), stamped here as they are sent.

The socket is the worker life's lane (a socketpair, shm/doorbell.py) or, with workers.doorbell:
zmq, a DEALER; both keep the broker's order, so a Withdraw still follows its Batch.
"""
from __future__ import annotations

from collections import deque

import zmq

from tgw.shm.doorbell import Lane
from tgw.shm.wire import Done, Withdraw, encode, to_worker_decoder


class Mailbox:
    def __init__(self, sock: Lane | zmq.Socket):
        """`sock`: the worker's lane (shm/doorbell.py) or its DEALER (workers.doorbell: zmq)."""
        self.sock = sock
        self.parked: deque = deque()
        self.withdrawn: dict[int, set[int]] = {}   # batch id (not launched yet) -> requests withdrawn
        self.launched_upto = -1                    # the last batch id launched: later Withdraws for it are late
        self.reporting: dict[int, list[int]] = {}  # batch id -> what its completions say it left out

    def next(self):
        """The next message: a parked one first, else the next off the socket (blocking)."""
        if self.parked:
            return self.parked.popleft()
        return self.read()

    def read(self):
        """The next message off the socket, past any parked one (blocking)."""
        msg = to_worker_decoder.decode(self.sock.recv())
        if type(msg) is Withdraw and msg.batch_id > self.launched_upto:
            # batch ids only grow, and a worker takes its batches in order: a larger id is still waiting
            self.withdrawn.setdefault(msg.batch_id, set()).update(msg.requests)
        return msg

    def look_ahead(self) -> None:
        """Read (without blocking) what is already waiting on the socket, parking it in order;
        the withdrawals among it are noted (and not parked: nothing else is left to do with them)."""
        while self.sock.poll(0):
            msg = self.read()
            if type(msg) is not Withdraw:
                self.parked.append(msg)

    def launch(self, batch_id: int) -> set[int]:
        """The batch launches now: the requests withdrawn from it (none from now on)."""
        self.launched_upto = max(self.launched_upto, batch_id)
        return self.withdrawn.pop(batch_id, set())

    def report(self, batch_id: int, withdrawn: list[int]) -> None:
        """The batch's completions are to say it left these requests out."""
        self.reporting[batch_id] = withdrawn

    def park(self, msg) -> None:
        self.parked.append(msg)

    def arrived(self, timeout_ms: int = 0) -> bool:
        """Whether a message is waiting on the socket (parked ones not counted)."""
        return bool(self.sock.poll(timeout_ms))

    def send(self, msg) -> None:
        if self.reporting and type(msg) is Done:
            left_out = self.reporting.get(msg.batch_id)
            if left_out is not None:
                msg.withdrawn = left_out
                if msg.final:
                    del self.reporting[msg.batch_id]
        self.sock.send(encode(msg))
