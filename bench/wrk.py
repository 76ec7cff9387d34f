"""HTTP load from `wrk` (a compiled generator), for the Flask baseline.

`ensure_wrk()` finds wrk, or installs the Debian package quietly when running as root with
apt-get available; it returns None otherwise and the caller falls back to the Python generator
(loadgen.py with an HttpTarget: keep-alive http.client, several processes x threads - slower per
request than wrk, so the fallback is marked in the results).

wrk posts a JSON body read from a file by a Lua script; the script's `done()` prints the latency
percentiles (p50/p90/p99/p99.9, microseconds) and error counts as one JSON line tagged
`TGW_WRK_JSON`, which `parse_wrk()` reads. Should that line be missing, the `--latency`
distribution block and `Requests/sec` of wrk's normal report are parsed instead.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
from typing import Any, Optional

LUA = r"""
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local f = assert(io.open("%(body)s", "rb"))
wrk.body = f:read("*a")
f:close()

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'TGW_WRK_JSON {"requests":%%d,"duration_us":%%d,"bytes":%%d,' ..
    '"errors":{"connect":%%d,"read":%%d,"write":%%d,"status":%%d,"timeout":%%d},' ..
    '"latency_us":{"p50":%%.1f,"p90":%%.1f,"p99":%%.1f,"p99_9":%%.1f,"mean":%%.1f,"max":%%.1f}}\n',
    summary.requests, summary.duration, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency:percentile(99.9), latency.mean, latency.max))
end
"""


def ensure_wrk(quiet: bool = True) -> Optional[str]:
    path = shutil.which("wrk")
    if path or os.geteuid() != 0 or not shutil.which("apt-get"):
        return path
    out = subprocess.DEVNULL if quiet else None
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "install", "-y", "-qq", "wrk"], ["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "wrk"]):
        try:
            subprocess.run(cmd, stdout=out, stderr=out, env=env, timeout=300, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if shutil.which("wrk"):
            break
    return shutil.which("wrk")


def write_lua(body_path: str, lua_path: str) -> str:
    with open(lua_path, "w") as f:
        f.write(LUA % {"body": body_path.replace("\\", "\\\\").replace('"', '\\"')})
    return lua_path


def wrk_argv(wrk: str, url: str, lua: str, connections: int, seconds: int, timeout_s: int = 60) -> list[str]:
    threads = max(1, min(connections, 2))
    return [wrk, "-t", str(threads), "-c", str(connections), "-d", f"{seconds}s",
            "--timeout", f"{timeout_s}s", "--latency", "-s", lua, url]


_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3, "h": 3600e3}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m|h)", text.strip())
    if not m:
        raise ValueError(f"unparsable wrk time {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse_wrk(stdout: str) -> dict[str, Any]:
    """-> {requests, duration_s, errors{kind: n}, latency_ms{p50,p90,p99,p99_9,...}, source}."""
    for line in stdout.splitlines():
        if line.startswith("TGW_WRK_JSON "):
            d = json.loads(line[len("TGW_WRK_JSON "):])
            return {"requests": d["requests"], "duration_s": d["duration_us"] / 1e6,
                    "errors": {k: v for k, v in d["errors"].items() if v},
                    "latency_ms": {k: v / 1e3 for k, v in d["latency_us"].items()}, "source": "lua"}
    # fallback: wrk's human report
    lat: dict[str, float] = {}
    block = re.search(r"Latency Distribution\s*\n((?:\s+[\d.]+%\s+\S+\s*\n)+)", stdout)
    if block:
        for pct, val in re.findall(r"([\d.]+)%\s+(\S+)", block.group(1)):
            lat["p" + f"{float(pct):g}".replace(".", "_")] = _ms(val)
    m = re.search(r"(\d+) requests in ([\d.]+)(us|ms|s|m)", stdout)
    if not m:
        raise ValueError(f"no wrk summary in output:\n{stdout[-2000:]}")
    errors: dict[str, int] = {}
    e = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", stdout)
    if e:
        errors = {k: int(v) for k, v in zip(("connect", "read", "write", "timeout"), e.groups()) if int(v)}
    s = re.search(r"Non-2xx or 3xx responses: (\d+)", stdout)
    if s:
        errors["status"] = int(s.group(1))
    return {"requests": int(m.group(1)), "duration_s": _ms(m.group(2) + m.group(3)) / 1e3,
            "errors": errors, "latency_ms": lat, "source": "text"}


def run_wrk(wrk: str, url: str, lua: str, connections: int, seconds: float, timeout_s: int = 60) -> dict[str, Any]:
    secs = max(1, math.ceil(seconds))
    argv = wrk_argv(wrk, url, lua, connections, secs, timeout_s)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=secs + timeout_s + 30)
    if proc.returncode != 0:
        raise RuntimeError(f"wrk failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    res = parse_wrk(proc.stdout)
    res["argv"] = argv
    return res
