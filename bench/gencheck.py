"""Is the load generator the bottleneck? Drive the transport-floor echo at a fixed concurrency
with 1, 2 and 4 generator processes and compare: if more generator processes do not raise the
rate, the generator is not what limits it.

    python -m tgw.bench.gencheck [--concurrency 64] [--duration 3] [--payload 1024]
"""
from __future__ import annotations

import argparse
import shutil
import tempfile

from tgw.bench.loadgen import LoadSpec
from tgw.bench.procs import sigterm_as_interrupt
from tgw.bench.runner import measure
from tgw.bench.targets import ZmqEchoTarget
from tgw.bench.transport import EchoServer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--payload", type=int, default=1024, help="request bytes (reply: 40 bytes)")
    ap.add_argument("--procs", default="1,2,4")
    a = ap.parse_args(argv)
    sigterm_as_interrupt()
    work = tempfile.mkdtemp(prefix="tgwg-", dir="/tmp")
    srv = EchoServer(work)
    try:
        print(f"transport-floor echo, concurrency {a.concurrency}, {a.payload} B requests")
        print(f"{'procs':>5} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'gen cores':>9} {'max/proc':>8} "
              f"{'machine':>7} {'other':>6}")
        for n in [int(x) for x in a.procs.split(",")]:
            s = measure(ZmqEchoTarget(srv.front, a.payload, 40),
                        LoadSpec("closed", a.concurrency, a.duration, a.warmup, n), srv.processes, progress=False)
            g, m = s["generator"], s["machine"]
            print(f"{n:>5} {s['throughput_rps']:>9,.0f} {s['latency_ms']['p50']:>8.3f} {s['latency_ms']['p99']:>8.3f} "
                  f"{g['cpu_cores']:>9.2f} {max(g['cpu_per_proc']):>8.2f} {m['cpu_busy'] or 0:>7.0%} "
                  f"{m['other_cpu_cores'] or 0:>6.2f}", flush=True)
    except KeyboardInterrupt:
        return 130
    finally:
        srv.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
