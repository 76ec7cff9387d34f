"""Where the CPU of one request goes: the broker (by thread, with perf, py-spy or cProfile) under
load, and the sync client's own cost per `infer` (bench/README.md quotes both).

    python -m tgw.bench.profile_broker broker --concurrency 64 --duration 15 [--transport]
        [--http json|binary] [--perf PATH] [--py-spy PATH] [--cprofile wall|cpu | --split] [--out DIR]
    python -m tgw.bench.profile_broker client --threads 1,8 --rounds 5 [--client NAME=WHERE ...]

`broker` starts a broker with the comparison's config (the demo models, one cpu worker per core),
loads it through the load generator and reports, over the window, the broker's CPU per request
by thread (/proc/PID/task/*/stat; with --transport the echo broker's first, under the same load;
with --http through its KServe v2 HTTP face, the comparison's JSON or binary body, by the Python
HTTP generator),
perf's on-CPU split by thread and library, py-spy's split of the Python work by area (the
reports: profile_reports.py), cProfile's calls per request or, with --split, the main thread's CPU
by step (cpu_split.py; the broker then runs under `_run-broker`, SIGUSR2 toggling either).
`client`: client_cost.py. Numbers only mean anything as ratios within one run.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional

from tgw.bench import client_cost, comparison, cpu_split
from tgw.bench.profile_reports import cprofile_report, report_perf, report_pyspy
from tgw.broker.child import BrokerProc, Proc, stop_all
from tgw.bench.loadgen import LoadSpec
from tgw.bench.measure import loadgen_drive, measure
from tgw.bench.targets import TgwTarget, find_model, v2_body, v2_target

TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (thread name, user + system CPU seconds) of every thread of pid."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / TICK)  # utime, stime
    return out


# the broker's work by area: the first of these functions found in a sample's stack, innermost
# first, names its area (samples whose innermost frame is the event loop itself are counted apart)
class ProfiledBroker(BrokerProc):
    """The same broker started through `_run-broker PROFILE`, so SIGUSR2 toggles cProfile in it."""

    def start(self, wait: bool = True, timeout: float = 60.0, env: Optional[dict] = None) -> "ProfiledBroker":
        self.argv = [sys.executable, "-m", "tgw.bench.profile_broker", "_run-broker", self.profile_path,
                     "start", "--config", self.config_path, "--address", self.address]
        Proc.start(self, env)
        if wait:
            self.wait_ready(timeout)
        return self


def run_profiled_broker(profile_path: str, argv: list[str]) -> None:
    """tgw-broker ARGS; the first SIGUSR2 starts cProfile on the uvloop thread, the next stops it and
    writes PROFILE. Timer ($TGW_PROFILE_TIMER): wall, cProfile's own clock (less overhead), or cpu,
    time.thread_time (a system call per event)."""
    if os.environ.get("TGW_PROFILE_TIMER") == "split":   # cpu_split's counters instead of cProfile
        split = cpu_split.Split()
        split.install()
        signal.signal(signal.SIGUSR2, lambda signum, frame: split.toggle(profile_path))
        from tgw.broker.cli.main import main as broker_main
        return broker_main(argv)
    import cProfile
    prof = cProfile.Profile(time.thread_time) if os.environ.get("TGW_PROFILE_TIMER") == "cpu" else cProfile.Profile()
    on = []

    def toggle(signum, frame) -> None:  # runs on the main (uvloop) thread, between bytecodes
        if not on:
            on.append(prof.enable())
            return
        prof.disable()
        prof.dump_stats(profile_path + ".tmp")
        os.replace(profile_path + ".tmp", profile_path)
        on.clear()
    signal.signal(signal.SIGUSR2, toggle)
    from tgw.broker.cli.main import main as broker_main
    broker_main(argv)


def start_broker(work: str, workers: int, profile_path: Optional[str] = None) -> BrokerProc:
    cfg = comparison.tgw_config(comparison.demo_models(os.path.join(work, "models")), ["mlp", "resnet", "resnet224"],
                                workers)
    srv = ProfiledBroker(cfg, work) if profile_path else BrokerProc(cfg, work)
    srv.profile_path = profile_path
    return srv.start(timeout=180)


def per_thread_us(a0: dict, a1: dict, n: int, main_tid: int) -> list[tuple[str, float]]:
    """(thread, CPU µs per request) between two thread_cpu() readings, busiest first."""
    rows = [(f"{name} (tid {tid}{', main' if tid == main_tid else ''})", (cpu - a0.get(tid, ("", 0.0))[1]) / n * 1e6)
            for tid, (name, cpu) in a1.items()]
    return sorted((r for r in rows if r[1] > 0), key=lambda r: -r[1])


def window(a: argparse.Namespace, target, processes: list, pid: int, at_start=(), at_end=(), stats=None):
    """measure() one closed-loop level; the thread CPU of `pid` and the hooks at the window's edges."""
    edges: list[dict] = []

    def drive(target, spec, on_window_start, on_window_end):
        start = lambda: [on_window_start(), edges.append(thread_cpu(pid)), *(h(spec) for h in at_start)]  # noqa: E731
        end = lambda: [edges.append(thread_cpu(pid)), *(h() for h in at_end), on_window_end()]  # noqa: E731
        return loadgen_drive(target, spec, on_window_start=start, on_window_end=end)
    row = measure(target, LoadSpec("closed", a.concurrency, a.duration, a.warmup, a.procs), processes, stats=stats,
                  drive=drive)
    n = row["requests_ok"] + row["requests_failed"]
    us = row["cpu_us_per_request"]
    print(f"{target.label} {a.model} c={a.concurrency}: {row['throughput_rps']:,.0f} req/s, p50 "
          f"{row['latency_ms']['p50']:.3f} ms, p99 {row['latency_ms']['p99']:.3f} ms, {n:,d} requests"
          + (f", mean batch {row['broker_stats']['mean_batch_rows'] or 0:.1f} rows" if stats else "")
          + f"\nCPU us/request: broker {us['broker']:.1f}, workers {us['workers']:.1f}, generator "
          f"{us['generator']:.1f}; server tree PSS {row['server_pss_mb']} MiB\nbroker threads, CPU us/request:")
    for name, v in per_thread_us(*edges, n, pid):
        print(f"  {v:8.1f}  {name}")
    return row, n, (edges[1][pid][1] - edges[0][pid][1]) / n * 1e6


def profile_broker(a: argparse.Namespace) -> int:
    from tgw.bench.baselines import EchoServer
    from tgw.bench.targets import ZmqEchoTarget, tensor_bytes
    from tgw.client import Client
    work = tempfile.mkdtemp(prefix="tgwp-", dir="/tmp")
    out = a.out or tempfile.mkdtemp(prefix="tgwp-out-", dir="/tmp")  # kept: the profiles are read after
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, f"broker-{a.model}-c{a.concurrency}")
    raw, perf_data = stem + ".pyspy.txt", stem + ".perf.data"
    prof_path = stem + ".cprofile" if a.cprofile else stem + ".split.json" if a.split else None
    if a.transport:
        m = comparison.demo_models(os.path.join(work, "models"))[a.model]
        echo = EchoServer(work)
        try:
            window(a, ZmqEchoTarget(echo.front, tensor_bytes(m["inputs"]), tensor_bytes(m["outputs"])),
                   echo.processes, echo.broker.pid)
        finally:
            echo.stop()
        print()
    os.environ["TGW_PROFILE_TIMER"] = a.cprofile or ("split" if a.split else "")  # the profiled broker reads it
    srv, spies = start_broker(work, a.workers, prof_path), []
    try:
        with Client(srv.address) as c:
            processes = c.stats()["processes"]
            pid = next(p["pid"] for p in processes if p["role"] == "broker")
            toggle = [lambda *_: os.kill(pid, signal.SIGUSR2)] if prof_path else []
            argvs = ([[a.perf, "record", "-e", "cpu-clock", "-F", str(a.perf_rate), "-g", "-p", str(pid), "-o",
                       perf_data, "--", "sleep", str(a.duration)]] if a.perf else []) + \
                ([[a.py_spy, "record", "--pid", str(pid), "--duration", str(int(a.duration)), "--rate", str(a.rate),
                   "--nonblocking", "--format", "raw", "--output", raw]] if a.py_spy else [])
            spy = [lambda _: spies.extend(subprocess.Popen(v, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                                          for v in argvs)]
            target = TgwTarget(srv.address, a.model, timeout=60.0)
            if a.http:
                body, header = v2_body(find_model(c.models(), a.model), a.http == "binary")
                with open(os.path.join(work, "body"), "wb") as f:
                    f.write(body)
                target = v2_target(c.status()["http"], a.model, f.name, header, a.http == "binary",
                                   f"tgw HTTP {a.http}")
            row, n, main_us = window(a, target, processes, pid, at_start=toggle + spy, at_end=toggle, stats=c.stats)
            for p in spies:
                err = p.communicate(timeout=120)[1]
                if p.returncode:
                    print(f"{p.args[0]} failed ({p.returncode}): {err.decode(errors='replace')[-800:]}")
    finally:
        code = srv.stop(timeout=30)
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"broker exit status {code}; profiles in {out}")
    python_us = report_perf(a, perf_data, row["cpu_us_per_request"]["broker"]) if a.perf else None
    if a.py_spy and os.path.exists(raw):
        report_pyspy(a, raw, python_us or main_us, python_us is not None)
    if prof_path:
        deadline = time.monotonic() + 30
        while not os.path.exists(prof_path) and time.monotonic() < deadline:
            time.sleep(0.1)
        if a.split:
            cpu_split.report(prof_path, n, main_us)
        else:
            cprofile_report(prof_path, n, main_us, a.top)
    return 0 if code == 0 and not row["requests_failed"] else 1


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_run-broker"]:
        run_profiled_broker(argv[1], argv[2:])
        return 0
    ap = argparse.ArgumentParser(prog="python -m tgw.bench.profile_broker", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    b = sub.add_parser("broker", help="the broker's CPU per request by thread, and where it goes")
    c = sub.add_parser("client", help="the sync client's own CPU per infer")
    add = b.add_argument
    add("--concurrency", type=int, default=64)
    add("--procs", type=int, default=0, help="generator processes (default: as tgw-bench)")
    add("--transport", action="store_true", help="first the echo broker under the same load")
    add("--http", choices=("json", "binary"), help="load the broker through its HTTP face (KServe v2 JSON or "
                                                  "binary body) instead of the tgw client")
    add("--perf", help="path of perf: the broker's on-CPU samples (native frames, kernel)")
    add("--perf-rate", type=int, default=999, help="perf samples per second (default 999)")
    add("--py-spy", help="path of py-spy: the broker's Python stacks")
    add("--rate", type=int, default=200, help="py-spy samples per second (default 200)")
    add("--cprofile", choices=("wall", "cpu"), help="cProfile the uvloop thread (timer: cProfile's clock or "
                                                    "the thread's CPU time): calls per request")
    add("--split", action="store_true", help="the main thread's CPU by step (bench/cpu_split.py), instead of "
        "--cprofile")
    add("--top", type=int, default=25)
    add("--out", help="folder for the profiles (default: a new /tmp/tgwp-out-* folder)")
    add("--keep", action="store_true", help="keep the work folder (models, config, broker log)")
    c.add_argument("--threads", type=lambda t: [int(x) for x in t.split(",")], default=[1])
    c.add_argument("--client", action="append", metavar="NAME=WHERE",
                   help="a Client: module name or folder with a copy of client/ (repeatable; default tgw.client)")
    c.add_argument("--rounds", type=int, default=3)
    c.add_argument("--address", help="an already running broker (default: start one here)")
    for p in (b, c):
        p.add_argument("--model", default="mlp")
        p.add_argument("--duration", type=float, default=10.0)
        p.add_argument("--warmup", type=float, default=2.0)
        p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="cpu workers (default: cores)")
    a = ap.parse_args(argv)
    try:
        return profile_broker(a) if a.what == "broker" else client_cost.profile_client(a, start_broker)
    finally:
        stop_all()


if __name__ == "__main__":
    sys.exit(main())
