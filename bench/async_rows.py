"""The AsyncClient rows (issue 12): one process, one connection, against the multi-process
generator in the same run; and what callers see when the broker dies under them.

1. `mlp`, closed loop: `tgw-bench load`'s spawned processes at c=64, then one AsyncClient
   in this process at c=256 (uvloop); throughput, latency and broker CPU per request of each.
2. Broker death under 1,000 calls in flight (closed loop, mlp, each caller stops at its first
   error): SIGKILL (a crash; the broker is then started again at the same address), and SIGSTOP
   (a hung broker: only heartbeats can tell). For each, how long after the event the calls in
   flight at it ended, and how long the calls sent after it took (they wait for a broker at most
   `liveness`), against `liveness`; for the restart, how long until calls succeed again.

    python -m tgw.bench.async_rows [--duration 10] [--liveness 2] [--json FILE]
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from typing import Any, Optional

import numpy as np
import psutil

from tgw.bench.loadgen import LoadSpec
from tgw.bench.measure import latency_ms, loadgen_drive
from tgw.bench.selfhosted import demo_broker, main as run_main, parser as make_parser
from tgw.bench.targets import TgwTarget

X = np.random.default_rng(0).random((1, 256), dtype=np.float32)


def broker_cpu(pid: int) -> float:
    """CPU seconds of the broker process, all its threads (its workers are other processes)."""
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


async def async_closed_loop(address: str, concurrency: int, warmup: float, duration: float, pid: int) -> dict:
    from tgw.client.aio import AsyncClient
    lat: list[float] = []
    errors: dict[str, int] = {}
    async with AsyncClient(address) as ac:
        t0 = time.monotonic()
        ws, we = t0 + warmup, t0 + warmup + duration
        cpu = {}

        async def caller():
            while (start := time.monotonic()) < we:
                try:
                    await ac.infer("mlp", {"x": X})
                    if start >= ws:
                        lat.append(time.monotonic() - start)
                except Exception as exc:  # noqa: BLE001 - counted by code
                    key = getattr(getattr(exc, "code", None), "value", type(exc).__name__)
                    errors[key] = errors.get(key, 0) + 1

        async def edges():
            await asyncio.sleep(warmup)
            cpu["start"] = broker_cpu(pid)
            await asyncio.sleep(duration)
            cpu["end"] = broker_cpu(pid)
        await asyncio.gather(edges(), *[caller() for _ in range(concurrency)])
    n = len(lat)
    return {"concurrency": concurrency, "requests": n, "rps": n / duration, "errors": errors,
            "latency_ms": latency_ms(np.array(lat)), "broker_cpu_us_per_request": (cpu["end"] - cpu["start"]) / max(n, 1) * 1e6}


def multi_process_row(address: str, concurrency: int, warmup: float, duration: float, pid: int) -> dict:
    cpu = {}
    target = TgwTarget(address, "mlp")
    s = loadgen_drive(target, LoadSpec("closed", concurrency, duration, warmup),
                      on_window_start=lambda: cpu.setdefault("start", broker_cpu(pid)),
                      on_window_end=lambda: cpu.setdefault("end", broker_cpu(pid)))
    n = s["requests_ok"] if "requests_ok" in s else int(s.get("throughput_rps", 0) * duration)
    s["broker_cpu_us_per_request"] = (cpu["end"] - cpu["start"]) / max(n, 1) * 1e6
    return s


async def death_under_load(broker, event: str, liveness: float, inflight: int = 1000, settle: float = 2.0) -> dict:
    """`inflight` closed-loop callers; `event` ("kill" or "stop") hits the broker once they run;
    every caller stops at its first error. How long after the event did the calls in flight at it
    end, and how long did the calls sent after it (while no broker answered) take?"""
    from tgw.client.aio import AsyncClient
    ended: list[tuple[float, float]] = []   # (start, end) of each caller's failing call
    codes: dict[str, int] = {}
    ok = 0
    async with AsyncClient(broker.address, liveness=liveness) as ac:
        async def caller():
            nonlocal ok
            while True:
                start = time.monotonic()
                try:
                    await ac.infer("mlp", {"x": X})
                    ok += 1
                except Exception as exc:  # noqa: BLE001 - the row is about how calls end
                    ended.append((start, time.monotonic()))
                    key = getattr(getattr(exc, "code", None), "value", type(exc).__name__)
                    codes[key] = codes.get(key, 0) + 1
                    return

        tasks = [asyncio.ensure_future(caller()) for _ in range(inflight)]
        await asyncio.sleep(settle)
        in_flight = ac.inflight
        at = time.monotonic()
        os.kill(broker.pid, signal.SIGKILL if event == "kill" else signal.SIGSTOP)
        await asyncio.gather(*tasks)
        before = [end - at for start, end in ended if start <= at]
        after = [end - start for start, end in ended if start > at]
        row: dict[str, Any] = {"event": event, "liveness_s": liveness, "in_flight_at_event": in_flight,
                               "ok_before": ok, "ended_by": codes, "calls_in_flight": len(before),
                               "in_flight_ended_within_s": max(before, default=0.0),
                               "calls_sent_after": len(after), "sent_after_took_at_most_s": max(after, default=0.0)}
        if event == "stop":
            os.kill(broker.pid, signal.SIGCONT)
        else:
            broker.proc.wait()
            restart = time.monotonic()
            await asyncio.to_thread(broker.start)
            await ac.infer("mlp", {"x": X}, timeout=30)
            row["serving_again_after_restart_s"] = time.monotonic() - restart
    return row


def run(argv: Optional[list[str]] = None) -> tuple[int, dict]:
    p = make_parser("tgw-bench async", __doc__)
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per throughput row")
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--liveness", type=float, default=2.0, help="the AsyncClient's liveness in the death rows")
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args(argv)
    import uvloop
    out: dict[str, Any] = {}
    with demo_broker(["mlp"], a.workers) as (broker, _):
        mp = multi_process_row(broker.address, 64, a.warmup, a.duration, broker.pid)
        print(f"tgw-bench (processes) c=64: {mp['throughput_rps']:,.0f} req/s, p99 {mp['latency_ms']['p99']:.2f} ms, "
              f"broker CPU {mp['broker_cpu_us_per_request']:.1f} us/req", flush=True)
        one = uvloop.run(async_closed_loop(broker.address, 256, a.warmup, a.duration, broker.pid))
        print(f"AsyncClient (1 process) c=256: {one['rps']:,.0f} req/s, p99 {one['latency_ms']['p99']:.2f} ms, "
              f"broker CPU {one['broker_cpu_us_per_request']:.1f} us/req, errors {one['errors']}", flush=True)
        ratio = one["rps"] / mp["throughput_rps"]
        print(f"ratio AsyncClient c=256 / tgw-bench c=64 = {ratio:.2f}x (issue 12 asks >= 0.8)", flush=True)
        out["throughput"] = {"tgw_bench_c64": mp, "async_c256": one, "ratio": ratio}
        deaths = []
        for event in ("stop", "kill"):
            row = uvloop.run(death_under_load(broker, event, a.liveness))
            deaths.append(row)
            print(f"broker SIG{event.upper()} under {row['in_flight_at_event']} calls in flight: those "
                  f"{row['calls_in_flight']} ended within {row['in_flight_ended_within_s']:.3f} s of it, the "
                  f"{row['calls_sent_after']} sent after it took at most {row['sent_after_took_at_most_s']:.3f} s "
                  f"(liveness {a.liveness:g} s); ended by {row['ended_by']}"
                  + (f"; serving again {row['serving_again_after_restart_s']:.2f} s after the restart began"
                     if event == "kill" else ""), flush=True)
        out["deaths"] = deaths
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
        print(f"wrote {a.json}")
    within = all(max(r["in_flight_ended_within_s"], r["sent_after_took_at_most_s"]) <= a.liveness + 0.5
                 for r in out["deaths"])
    return (0 if within else 1), out


if __name__ == "__main__":
    raise SystemExit(run_main(run))
