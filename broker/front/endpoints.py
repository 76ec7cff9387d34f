"""The broker's two sockets: the clients' front door and the workers' back door.

ipc:// sockets live in a private directory (server.socket_dir_mode, 0750 by default, group
server.socket_group): an existing directory that group or others may write is fixed when it is
ours and refused otherwise, since whoever may write it can replace the socket. The front socket
is 0660 (callers in the broker's group), the back socket 0600 (workers run as the broker's
user). A stale socket file left by a dead broker is replaced; a live broker on the same path is
refused. The front socket refuses frames over the request limits before receiving them
(ZMQ_MAXMSGSIZE: libzmq drops such a connection), queues at most client_queue_messages
replies per caller, and puts every new connection to a ZAP handler (see callers.py).
"""
from __future__ import annotations

import grp
import logging
import os
import socket
import stat

import zmq

from tgw.shm.paths import ipc_path, runtime_dir

from tgw.broker.config.startup import StartupError

from .auth import curve_server
from tgw.broker.config.schema import ServerDecl

log = logging.getLogger("tgw.broker")
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP specification (RFC 27)


def backend_address(front: str) -> str:
    """The workers' socket: beside an ipc front socket, else in the runtime directory."""
    path = ipc_path(front)
    run_dir = os.path.dirname(path) if path else runtime_dir()
    return f"ipc://{run_dir}/tgw-{os.getpid()}.w.sock"


def _group_id(server: ServerDecl) -> int:
    if server.socket_group is None:
        return -1
    try:
        return grp.getgrnam(server.socket_group).gr_gid
    except KeyError:
        raise StartupError(f"server.socket_group {server.socket_group!r}: no such group") from None


def private_dir(directory: str, server: ServerDecl) -> None:
    """Create the socket directory with the configured mode, or make sure an existing one is private."""
    mode, gid = server.dir_mode, _group_id(server)
    try:
        if not os.path.isdir(directory):
            os.makedirs(directory, mode=mode, exist_ok=True)
            os.chmod(directory, mode)  # makedirs' mode passes through the umask
        st = os.stat(directory)
        if stat.S_IMODE(st.st_mode) & 0o022:
            if st.st_uid != os.geteuid():
                raise StartupError(f"socket directory {directory} (mode {stat.S_IMODE(st.st_mode):04o}, owner uid "
                                   f"{st.st_uid}) may be written by other users, who could replace the socket; "
                                   "put the socket in a directory of this user's (server.address)")
            log.warning("socket directory %s had mode %04o (others could replace the socket): set to %04o",
                        directory, stat.S_IMODE(st.st_mode), mode)
            os.chmod(directory, mode)
        if gid != -1 and st.st_gid != gid:
            os.chown(directory, -1, gid)
    except OSError as exc:
        raise StartupError(f"socket directory {directory}: {exc.strerror}") from None


def prepare_ipc(address: str, server: ServerDecl) -> None:
    """A private directory for the socket; refuse if a live broker already listens there."""
    path = ipc_path(address)
    if path is None:
        return
    private_dir(os.path.dirname(path) or ".", server)
    if os.path.exists(path):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
            raise StartupError(f"another broker is already listening on {address}")
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(path)  # left by a broker that died
        finally:
            probe.close()


def bind(ctx: zmq.Context, address: str, server: ServerDecl, public: bool) -> zmq.Socket:
    prepare_ipc(address, server)
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)   # a send to a vanished peer errors instead of vanishing
    sock.setsockopt(zmq.RCVHWM, 100_000)
    if public:
        sock.setsockopt(zmq.ZAP_DOMAIN, b"tgw")   # every connection is put to the ZAP handler, NULL ones too
        sock.setsockopt(zmq.SNDHWM, server.client_queue_messages)
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes(server))
        if server.curve_secret_key_file:
            curve_server(sock, server.curve_secret_key_file)
    else:
        sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.bind(address)
    _own_socket_file(address, server, public)
    return sock


def max_frame_bytes(server: ServerDecl) -> int:
    """The largest frame a request may need: all its tensor bytes in one frame, plus lz4's worst
    case growth of incompressible data (under 0.4 %), or the largest header."""
    return max(server.max_request_bytes + server.max_request_bytes // 128 + 4096, server.max_header_bytes)


def _own_socket_file(address: str, server: ServerDecl, public: bool) -> None:
    path = ipc_path(address)
    if path:
        os.chmod(path, 0o660 if public else 0o600)
        if public and server.socket_group is not None:
            os.chown(path, -1, _group_id(server))


def zap_handler(ctx: zmq.Context) -> zmq.Socket:
    """The ZAP socket libzmq asks about every new front connection (before its first message);
    bound before the front socket, so no connection slips past it."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(ZAP_ENDPOINT)
    return sock


def remove_socket_files(*addresses: str) -> None:
    for addr in addresses:
        path = ipc_path(addr)
        if path and os.path.exists(path):
            os.unlink(path)
