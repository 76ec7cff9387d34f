"""wrk as the HTTP rows' load generator (when it is on $PATH): its Lua script for a target's body
and headers, its run, and its JSON report parsed into measure()'s summary."""
from __future__ import annotations

import json
import math
import resource
import subprocess
from typing import Any

from tgw.bench.harness.loadgen import LoadSpec, cpu_seconds
from tgw.bench.harness.measure import generator, summary
from tgw.bench.harness.targets import HttpTarget

WRK_INSTALL_HINT = ("wrk not found on $PATH: the Flask rows use the Python fallback generator, which spends more "
                    "CPU per request. For wrk: `sudo apt-get install wrk` (Debian/Ubuntu), `sudo dnf install wrk` "
                    "(Fedora), `brew install wrk` (macOS), or build https://github.com/wg/wrk")

WRK_LUA = r"""
wrk.method = "POST"
%(headers)s
local f = assert(io.open(%(body)s, "rb"))
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


def wrk_lua(target: HttpTarget) -> str:
    """wrk's script for `target`: its body file, content type and extra headers, and the done() report."""
    def lua_str(text: str) -> str:
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    headers = {"Content-Type": target.content_type, **target.headers}
    return WRK_LUA % {"body": lua_str(target.body_path),
                      "headers": "\n".join(f"wrk.headers[{lua_str(k)}] = {lua_str(v)}" for k, v in headers.items())}


def wrk_drive(wrk: str, target: HttpTarget, spec: LoadSpec, on_window_start, on_window_end) -> dict[str, Any]:
    """measure()'s drive for the HTTP rows: a closed loop of spec.level connections."""
    url = f"http://{target.host}:{target.port}{target.path}"
    lua = target.body_path + ".lua"
    with open(lua, "w") as f:
        f.write(wrk_lua(target))
    conns = int(spec.level)
    if spec.warmup > 0:
        run_wrk(wrk, url, lua, conns, spec.warmup)
    cpu0 = cpu_seconds(resource.RUSAGE_CHILDREN)
    on_window_start()
    res = run_wrk(wrk, url, lua, conns, spec.duration)
    on_window_end()
    dur, threads = res["duration_s"], int(res["argv"][2])
    gen_cpu = (cpu_seconds(resource.RUSAGE_CHILDREN) - cpu0) / dur
    # wrk counts completed responses in `requests` (non-2xx ones also in errors.status); socket
    # errors and timeouts are failed attempts outside it
    ok = max(0, res["requests"] - res["errors"].get("status", 0))
    latency = res["latency_ms"] if res["requests"] else dict.fromkeys(res["latency_ms"])
    s = summary(spec, dur, 1, ok, {f"wrk_{k}": v for k, v in res["errors"].items()}, {}, latency,
                generator("wrk", [threads], [gen_cpu], limit=0.9 * threads))
    s["generator"]["argv"] = res["argv"]
    return s
