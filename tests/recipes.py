"""The balancer recipes under configs/ rendered for real addresses, and started by PID.

A recipe is a working file for its documented layout (brokers on 127.0.0.1:8000/8010/8020, the
balancer on 8080); rendering swaps only its listen addresses and its server lines (one per
broker, each keeping the recipe's options), so the settings tested are the recipe's own.
"""
from __future__ import annotations

import os
import re
import shutil
import socket

from tgw.testing.child import Proc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAPROXY_RECIPES = [os.path.join(ROOT, "configs", "haproxy", n) for n in ("tgw.cfg", "tgw-hash.cfg")]
NGINX_RECIPES = [os.path.join(ROOT, "configs", "nginx", n) for n in ("tgw.conf", "tgw-hash.conf")]
HAPROXY_SERVER = re.compile(r"^(\s+)server tgw\d+ \S+( .*)?$", re.M)
NGINX_SERVER = re.compile(r"^(\s+)server 127\.0\.0\.1:\d+( [^;]*)?;$", re.M)
NOT_INSTALLED = "{} is not installed (scripts/test.sh installs it with apt-get when it may)"


def tool(name: str) -> str | None:
    """The balancer's binary: on PATH, else where Debian's package puts it (/usr/sbin)."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/local/sbin")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_port(url: str) -> str:
    return url.removeprefix("http://").rstrip("/")


def _servers(text: str, pattern: re.Pattern, line, addresses: list[str], what: str) -> str:
    found = list(pattern.finditer(text))
    assert found, f"{what}: no server lines matching {pattern.pattern!r}: the recipe changed shape"
    indent, options = found[0].group(1), found[0].group(2) or ""
    new = "\n".join(line(indent, i, a, options) for i, a in enumerate(addresses, 1))
    return text[:found[0].start()] + new + text[found[-1].end():]


def _swap(text: str, old: str, new: str, what: str) -> str:
    assert text.count(old) == 1, f"{what}: expected {old!r} once: the recipe changed shape"
    return text.replace(old, new)


def render_haproxy(recipe: str, listen: str, stats: str, brokers: list[str], socket_path: str = "") -> str:
    """The recipe with the balancer on `listen`, its stats page on `stats`, its stats socket at
    `socket_path` (default: beside nothing, dropped), and one server line per broker (host:port)."""
    with open(recipe) as f:
        text = f.read()
    sock = "    stats socket /run/haproxy/tgw.sock mode 600 level admin\n"
    text = _swap(text, sock, sock.replace("/run/haproxy/tgw.sock", socket_path) if socket_path else "", recipe)
    text = _swap(text, "bind :8080\n", f"bind {listen}\n", recipe)
    text = _swap(text, "bind 127.0.0.1:8404\n", f"bind {stats}\n", recipe)
    return _servers(text, HAPROXY_SERVER, lambda ind, i, a, opt: f"{ind}server tgw{i} {a}{opt}", brokers, recipe)


def render_nginx(recipe: str, prefix: str, port: int, brokers: list[str]) -> str:
    """A main nginx.conf under `prefix` (pid, logs and temp paths there: no root needed) that
    includes the recipe, rendered to listen on 127.0.0.1:`port` and proxy to `brokers`; its path."""
    with open(recipe) as f:
        text = f.read()
    text = _swap(text, "listen 8080;", f"listen 127.0.0.1:{port};", recipe)
    text = _servers(text, NGINX_SERVER, lambda ind, i, a, opt: f"{ind}server {a}{opt};", brokers, recipe)
    os.makedirs(os.path.join(prefix, "logs"), exist_ok=True)
    with open(os.path.join(prefix, "tgw.conf"), "w") as f:
        f.write(text)
    kinds = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    temp = " ".join(f"{kind}_temp_path {prefix}/{kind};" for kind in kinds)
    main = (f"daemon off;\nmaster_process on;\nworker_processes 1;\npid {prefix}/nginx.pid;\n"
            f"error_log {prefix}/logs/error.log notice;\nevents {{ worker_connections 256; }}\n"
            f"http {{\n  access_log off;\n  {temp}\n  include {prefix}/tgw.conf;\n}}\n")
    path = os.path.join(prefix, "nginx.conf")
    with open(path, "w") as f:
        f.write(main)
    return path


def haproxy_proc(config: str, log: str) -> Proc:
    """HAProxy in the foreground (-db: no daemon, logs to its stdout), to stop by its PID."""
    return Proc([tool("haproxy"), "-db", "-f", config], log, "haproxy")


def nginx_proc(config: str, prefix: str) -> Proc:
    return Proc([tool("nginx"), "-p", prefix, "-c", config], os.path.join(prefix, "nginx.out"), "nginx")


def unit_directives(text: str) -> dict[str, list[str]]:
    """'Section.Key' -> values in order (systemd keys repeat, so configparser will not do)."""
    section, found = "", {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        found.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return found
