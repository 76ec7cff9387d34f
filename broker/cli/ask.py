"""Asking a running broker over its native socket, for the `tgw-broker` verbs (status, ...).

The broker package may not import the client library (layering rule), and these verbs need
only one request and its reply: a DEALER, a hello to check the protocol, the request. Like the
client, they carry the shared token and speak CURVE when given the broker's public key.
"""
from __future__ import annotations

import itertools
import os

import zmq

from tgw.shm import keys
from tgw.shm.errors import error_from_body
from tgw.shm.paths import ADDRESS_FORMS, address_problem, ipc_path
from tgw.shm.wire import PROTOCOL_VERSION, ErrorReply, Hello, encode, reply_decoder

_ids = itertools.count(1)


class Unreachable(ConnectionError):
    pass


def server_public_key(value: str) -> bytes:
    """The broker's CURVE public key from its z85 text or its `.key` file (tgw.shm.keys: the
    client library has the same rule; the broker may not import it, docs/ARCHITECTURE.md, "Dependency rule")."""
    try:
        return keys.server_public_key(value)
    except keys.BadServerKey as exc:
        raise Unreachable(str(exc)) from None


def ask(address: str, msg, timeout_s: float = 5.0, *, token: str | None = None, server_key: str | None = None):
    """Send `msg` (its id and token are set here) and return the reply; raises Unreachable or the
    TgwError. `server_key`: the broker's CURVE public key (z85 text or its .key file)."""
    problem = address_problem(address)
    if problem:
        raise Unreachable(f"bad broker address {address!r}: {problem}; expected {ADDRESS_FORMS}")
    path = ipc_path(address)
    if path is not None and not os.path.exists(path):
        raise Unreachable(f"no tgw broker at {address}: {path} does not exist")
    if address.startswith("tcp://") and not server_key:
        raise Unreachable(f"{address}: a tcp:// broker only speaks CURVE; pass --server-key or set TGW_SERVER_KEY "
                          "to the broker's public key (its .key file or the z85 text)")
    key = server_public_key(server_key) if server_key else None
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        if key is not None:
            sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
            sock.curve_serverkey = key
        sock.connect(address)
        for m in (Hello(v=PROTOCOL_VERSION, id=0, client="tgw-broker"), msg):
            m.id = next(_ids)
            m.token = token
            sock.send(encode(m))
            if not sock.poll(int(timeout_s * 1000)):
                hint = " (a wrong server key looks the same)" if key is not None else ""
                raise Unreachable(f"no answer from {address} within {timeout_s:g} s{hint}")
            reply = reply_decoder.decode(sock.recv_multipart()[0])
            if isinstance(reply, ErrorReply):
                raise error_from_body(reply.error)
        return reply
    finally:
        sock.close()
        ctx.term()
