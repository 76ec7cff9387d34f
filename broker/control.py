"""Asking a running broker over its native socket, for the `tgw-broker` verbs (status, ...).

The broker package may not import the client library (layering rule), and these verbs need
only one request and its reply: a DEALER, a hello to check the protocol, the request.
"""
from __future__ import annotations

import itertools
import os

import zmq

from tgw.shm.errors import error_from_body
from tgw.shm.paths import ipc_path
from tgw.shm.wire import PROTOCOL_VERSION, ErrorReply, Hello, encode, reply_decoder

_ids = itertools.count(1)


class Unreachable(ConnectionError):
    pass


def ask(address: str, msg, timeout_s: float = 5.0):
    """Send `msg` (its id is set here) and return the reply; raises Unreachable or the TgwError."""
    path = ipc_path(address)
    if path is not None and not os.path.exists(path):
        raise Unreachable(f"no tgw broker at {address}: {path} does not exist")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        for m in (Hello(v=PROTOCOL_VERSION, id=0, client="tgw-broker"), msg):
            m.id = next(_ids)
            sock.send(encode(m))
            if not sock.poll(int(timeout_s * 1000)):
                raise Unreachable(f"no answer from {address} within {timeout_s:g} s")
            reply = reply_decoder.decode(sock.recv_multipart()[0])
            if isinstance(reply, ErrorReply):
                raise error_from_body(reply.error)
        return reply
    finally:
        sock.close()
        ctx.term()
