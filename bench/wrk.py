"""HTTP load for the Flask baseline: `wrk` where it is on $PATH, else the Python fallback.

A benchmark does not install system packages: without wrk the caller prints INSTALL_HINT and
uses `fallback_drive` (loadgen.py with an HttpTarget), whose rows say `python-fallback`. wrk
posts the body file from a Lua script whose `done()` prints the percentiles and error counts as
one `TGW_WRK_JSON` line.
"""
from __future__ import annotations

import json
import math
import os
import resource
import shutil
import subprocess
from typing import Any, Optional

from tgw.bench.loadgen import LoadSpec, cpu_seconds
from tgw.bench.measure import loadgen_drive
from tgw.bench.targets import HttpTarget

INSTALL_HINT = ("wrk not found on $PATH: the Flask rows use the Python fallback generator, which spends more "
                "CPU per request. For wrk: `sudo apt-get install wrk` (Debian/Ubuntu), `sudo dnf install wrk` "
                "(Fedora), `brew install wrk` (macOS), or build https://github.com/wg/wrk")

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


def find_wrk() -> Optional[str]:
    return shutil.which("wrk")


def parse_wrk(stdout: str) -> dict[str, Any]:
    """-> {requests, duration_s, errors{kind: n}, latency_ms{p50, p90, p99, p99_9, mean, max}}."""
    for line in stdout.splitlines():
        if line.startswith("TGW_WRK_JSON "):
            d = json.loads(line[len("TGW_WRK_JSON "):])
            return {"requests": d["requests"], "duration_s": d["duration_us"] / 1e6,
                    "errors": {k: v for k, v in d["errors"].items() if v},
                    "latency_ms": {k: v / 1e3 for k, v in d["latency_us"].items()}}
    raise ValueError(f"no TGW_WRK_JSON line in wrk's output:\n{stdout[-2000:]}")


def run_wrk(wrk: str, url: str, lua: str, connections: int, seconds: float, timeout_s: int = 60) -> dict[str, Any]:
    secs = max(1, math.ceil(seconds))  # wrk takes whole seconds
    argv = [wrk, "-t", str(max(1, min(connections, 2))), "-c", str(connections), "-d", f"{secs}s",
            "--timeout", f"{timeout_s}s", "--latency", "-s", lua, url]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=secs + timeout_s + 30)
    if proc.returncode != 0:
        raise RuntimeError(f"wrk failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    return {**parse_wrk(proc.stdout), "argv": argv}


def drive(wrk: str, target: HttpTarget, spec: LoadSpec, batch: int = 1, on_window_start=None, on_window_end=None,
          on_tick=None) -> dict[str, Any]:
    """A closed loop of spec.level connections; returns measure.summarize()'s shape (measure's `drive`)."""
    url = f"http://{target.host}:{target.port}{target.path}"
    lua = target.body_path + ".lua"
    with open(lua, "w") as f:
        f.write(LUA % {"body": target.body_path.replace("\\", "\\\\").replace('"', '\\"')})
    conns = int(spec.level)
    if spec.warmup > 0:
        run_wrk(wrk, url, lua, conns, spec.warmup)
    cpu0 = cpu_seconds(resource.RUSAGE_CHILDREN)
    if on_window_start:
        on_window_start()
    res = run_wrk(wrk, url, lua, conns, spec.duration)
    if on_window_end:
        on_window_end()
    dur, gen_cpu = res["duration_s"], (cpu_seconds(resource.RUSAGE_CHILDREN) - cpu0) / res["duration_s"]
    # wrk counts completed responses in `requests` (non-2xx ones also in errors.status); socket
    # errors and timeouts are failed attempts outside it
    ok = max(0, res["requests"] - res["errors"].get("status", 0))
    threads = int(res["argv"][2])
    return {"mode": "closed", "level": conns, "offered": "concurrency", "duration_s": dur, "warmup_s": spec.warmup,
            "batch": 1, "requests_ok": ok, "requests_failed": sum(res["errors"].values()),
            "throughput_rps": ok / dur, "rows_per_s": ok / dur,
            "latency_ms": res["latency_ms"] if res["requests"] else dict.fromkeys(res["latency_ms"]),
            "errors": {f"wrk_{k}": v for k, v in res["errors"].items()}, "error_messages": {},
            "generator": {"kind": "wrk", "argv": res["argv"], "procs": 1, "threads": [threads],
                          "cpu_cores": gen_cpu, "cpu_share_of_machine": gen_cpu / (os.cpu_count() or 1),
                          "cpu_per_proc": [gen_cpu], "saturated": gen_cpu >= 0.9 * threads}}


def fallback_drive(*args, **kw) -> dict[str, Any]:
    """The Python generator with an HttpTarget, marked as the fallback in every row it fills."""
    s = loadgen_drive(*args, **kw)
    s["generator"]["kind"] = "python-fallback"
    return s
