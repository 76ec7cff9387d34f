"""What a client connects with, from its arguments and the environment, checked before any
socket exists: the address, the token, the tenant and the broker's CURVE key.

A bad address must fail here: a ZeroMQ connect that refuses it leaves a socket behind, and
the context that owns it then waits forever in term().
"""
from __future__ import annotations

import os

import zmq

from tgw.shm import keys
from tgw.shm.paths import ADDRESS_ENV, ADDRESS_FORMS, address_problem, default_address

CONNECT_TIMEOUT_S = 5.0   # for the connection and the hello, and for each control call


class ConnectError(ConnectionError):
    """No tgw broker answered at the address (or the address or server key is unusable)."""


def check_address(address: str, source: str | None = None) -> str:
    """`address` if a client can connect to it (ipc://PATH, tcp://HOST:PORT: the rule the broker's
    config and verbs use too), else ConnectError naming it, where it came from (`source`, e.g.
    "$TGW_ADDRESS") and the accepted forms."""
    problem = address_problem(address)
    if problem:
        where = f" (from {source})" if source else ""
        raise ConnectError(f"bad broker address {address!r}{where}: {problem}; expected {ADDRESS_FORMS}")
    return address


def server_public_key(value: str | bytes) -> bytes:
    """A broker's CURVE public key from its z85 text (40 characters) or its `.key` certificate file."""
    try:
        return keys.server_public_key(value)
    except keys.BadServerKey as exc:
        raise ConnectError(str(exc)) from None


def settings(address: str | None, token: str | None, server_key: str | bytes | None) -> tuple:
    """(address, token, tenant, server key, the client's CURVE key pair) from the arguments and
    the environment ($TGW_ADDRESS by way of default_address, $TGW_TOKEN, $TGW_TENANT,
    $TGW_SERVER_KEY); raises ConnectError for a bad address or key, and for a tcp:// address
    without a server key."""
    source = None if address else f"${ADDRESS_ENV}" if os.environ.get(ADDRESS_ENV) else "the default"
    address = check_address(address or default_address(), source)
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
