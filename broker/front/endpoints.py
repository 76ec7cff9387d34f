"""The broker's two sockets: the clients' front door and the workers' back door.

ipc:// sockets: tgw changes only what it creates. A socket folder that does not exist is created
private (server.socket_dir_mode, 0750 by default, group server.socket_group). An existing folder
is left exactly as it is - mode, owner, group - and judged: one any user may write without the
sticky bit (or another user's that its group may write) is refused, since whoever may write it
can replace the socket; a shared one with the sticky bit (/tmp) serves, as only the socket's
owner may remove or rename it there, and the workers' socket then goes to the runtime directory
instead of beside it. There a socket file is born with its final mode (a umask around the bind,
no window in which others could connect); everywhere the front socket is 0660 (callers in the
broker's group), the back socket 0600 (workers run as the broker's user). A stale socket file
left by a dead broker is replaced; a live broker on the same path is refused. The front socket
refuses frames over the request limits before receiving them (ZMQ_MAXMSGSIZE: libzmq drops such
a connection), queues at most client_queue_messages replies per caller, and puts every new
connection to a ZAP handler (see callers.py).
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
    """The workers' socket: beside an ipc front socket in a private folder, else in the runtime
    directory (a tcp front, or a folder others share)."""
    path = ipc_path(front)
    run_dir = (os.path.dirname(path) or ".") if path else None
    if run_dir is None or _shared(run_dir):
        run_dir = runtime_dir()
    return f"ipc://{run_dir}/tgw-{os.getpid()}.w.sock"


def _shared(directory: str) -> bool:
    """An existing folder others may use: group or others may write it, it has the sticky bit, or
    it is another user's."""
    try:
        st = os.stat(directory)
    except OSError:
        return False   # tgw will create it, private
    return bool(st.st_mode & (0o022 | stat.S_ISVTX)) or st.st_uid != os.geteuid()


def _group_id(server: ServerDecl) -> int:
    if server.socket_group is None:
        return -1
    try:
        return grp.getgrnam(server.socket_group).gr_gid
    except KeyError:
        raise StartupError(f"server.socket_group {server.socket_group!r}: no such group") from None


def private_dir(directory: str, server: ServerDecl) -> None:
    """Create the socket folder private, or judge an existing one, which is left as it is."""
    try:
        if not os.path.isdir(directory):
            _create_private(directory, server)
        else:
            _judge_existing(directory, server)
    except OSError as exc:
        raise StartupError(f"socket directory {directory}: {exc.strerror}") from None


def _create_private(directory: str, server: ServerDecl) -> None:
    mode, gid = server.dir_mode, _group_id(server)
    os.makedirs(directory, mode=mode, exist_ok=True)
    os.chmod(directory, mode)  # makedirs' mode passes through the umask
    if gid != -1:
        os.chown(directory, -1, gid)


def _judge_existing(directory: str, server: ServerDecl) -> None:
    """Refuse a folder in which others could replace the socket; note a shared one; never change it."""
    st = os.stat(directory)
    mode, ours, sticky = stat.S_IMODE(st.st_mode), st.st_uid == os.geteuid(), bool(st.st_mode & stat.S_ISVTX)
    shown = f"{directory} (mode {mode:04o}, owner uid {st.st_uid})"
    if not sticky and (mode & 0o002 or (mode & 0o020 and not ours)):
        raise StartupError(f"socket directory {shown} may be written by other users, who could replace the socket; "
                           f"tgw leaves folders it did not create as they are: give the folder the sticky bit "
                           f"(chmod +t {directory}), or name a socket in a folder that does not exist yet, which "
                           f"tgw creates private (server.address, --address; e.g. ipc://{directory.rstrip('/')}/"
                           f"tgw-{os.geteuid()}/tgw.sock)")
    if not sticky and mode & 0o020:
        log.warning("socket directory %s: its group may write it, so its members could replace the socket; "
                    "left as it is (tgw changes only folders it creates)", shown)
    elif sticky and mode & 0o022:
        log.info("socket directory %s is shared: left as it is; the socket file is 0660 and only its owner may "
                 "remove it (sticky bit); the workers' socket is in %s", shown, runtime_dir())
    gid = _group_id(server)
    if gid != -1 and st.st_gid != gid and not mode & 0o001:
        log.warning("socket directory %s has group %d, not server.socket_group %r, and others may not enter it: "
                    "that group's members may not reach the socket (left as it is)", shown, st.st_gid,
                    server.socket_group)


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
            _remove_stale(path)
        finally:
            probe.close()


def _remove_stale(path: str) -> None:
    """A socket file left by a broker that died; another user's (in a shared folder) stays theirs."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise StartupError(f"a socket file {path} that no broker answers is in the way and cannot be removed "
                           f"({exc.strerror}): remove it, or name another socket (server.address, --address)") from None


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
    path = ipc_path(address)
    if path is not None and _shared(os.path.dirname(path) or "."):
        # the folder does not keep others out: the file is born 0660 / 0600 (the umask is the
        # process's: changed for this call alone, during start-up)
        old_umask = os.umask(0o117 if public else 0o177)
        try:
            sock.bind(address)
        finally:
            os.umask(old_umask)
    else:
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
