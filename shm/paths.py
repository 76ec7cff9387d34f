"""Where the broker listens by default; shared so the client finds the same socket."""
from __future__ import annotations

import os

ADDRESS_ENV = "TGW_ADDRESS"
IPC_PATH_MAX = 107  # sun_path limit, minus the terminating NUL


def runtime_dir() -> str:
    """$XDG_RUNTIME_DIR/tgw, else /run/tgw (the systemd RuntimeDirectory), else /tmp/tgw-<uid>."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return os.path.join(xdg, "tgw")
    if os.access("/run/tgw", os.W_OK) or (os.geteuid() == 0 and os.path.isdir("/run")):
        return "/run/tgw"
    return f"/tmp/tgw-{os.geteuid()}"


def default_address() -> str:
    return os.environ.get(ADDRESS_ENV) or f"ipc://{runtime_dir()}/tgw.sock"


def ipc_path(address: str) -> str | None:
    return address[len("ipc://"):] if address.startswith("ipc://") else None


def check_ipc_address(address: str) -> None:
    path = ipc_path(address)
    if path is not None and len(path.encode()) > IPC_PATH_MAX:
        raise ValueError(f"ipc socket path is {len(path.encode())} bytes, over the {IPC_PATH_MAX}-byte "
                         f"Unix socket limit: {path}")


ADDRESS_FORMS = "ipc://PATH or tcp://HOST:PORT"


def address_problem(address: object, bind: bool = False) -> str | None:
    """What is wrong with `address` as a tgw socket address (None: nothing). A client connects to
    ipc://PATH or tcp://HOST:PORT; a broker may also bind tcp://*:PORT (every interface)."""
    if not isinstance(address, str):
        return f"a {type(address).__name__}, not a string"
    path = ipc_path(address)
    if path is not None:
        if not path:
            return "no socket path after ipc://"
        try:
            check_ipc_address(address)
        except ValueError as exc:
            return str(exc)
        return None
    if not address.startswith("tcp://"):
        hint = f" (ipc://{address}?)" if address.startswith("/") else ""
        return f"no ipc:// or tcp:// scheme{hint}"
    host, colon, port = address[len("tcp://"):].rpartition(":")
    if not colon:
        return "no :PORT after the host"
    if not host or (host == "*" and not bind) or any(c.isspace() for c in host):
        return "no host to connect to" if not bind else "no host or * to bind"
    if not port.isdigit() or not (0 if bind else 1) <= int(port) < 65536:
        return f"port {port!r} is not a number from 1 to 65535"
    return None
