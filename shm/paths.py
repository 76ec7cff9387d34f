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
