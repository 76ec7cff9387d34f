"""Where the broker's CPU goes per request, by face: its threads' CPU under load, and its main
(uvloop) thread's split by step or cProfile's top functions (a dev tool, bench/README.md).

    python -m tgw.bench.profile_broker --face native|http-binary|http-json|grpc|grpc-stream
        [--concurrency 64] [--duration 10] [--warmup 2] [--split | --cprofile wall|cpu] [--out FILE]

It starts a broker with the comparison's config (the demo models, one cpu worker per core, the
HTTP and gRPC faces on free ports), loads it with the comparison's closed-loop generator (the
tgw client; the HTTP body by wrk when on $PATH, else the Python generator; the gRPC rows' grpc.aio
callers, unary or one stream each) and prints, over the window: req/s, p50, rows per batch, the
CPU per request of the broker, its workers and the generator, the broker's threads one by one,
and with --split the main thread's CPU by step (cpu_split.py: the broker then runs under
`_run-broker`, SIGUSR2 opening and closing the window) or with --cprofile cProfile's top
functions. Numbers only mean anything as ratios within one run. Brought back from bfd3729
(bench/results/RETIRED.md) for issue 43, with --face in place of --http and --transport.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import Optional

from tgw.bench import cpu_split
from tgw.bench.harness.loadgen import LoadSpec
from tgw.bench.harness.measure import loadgen_drive, measure
from tgw.bench.harness.targets import GrpcStreamTarget, GrpcTarget, TgwTarget, find_model, v2_body, v2_target
from tgw.bench.harness.wrk import wrk_drive
from tgw.testing.child import BrokerProc, Proc, stop_all
from tgw.testing.demo import demo_models, tgw_config

TICK = os.sysconf("SC_CLK_TCK")
FACES = ("native", "http-binary", "http-json", "grpc", "grpc-stream")


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


class ProfiledBroker(BrokerProc):
    """The same broker started through `_run-broker PROFILE`, so SIGUSR2 toggles the profile in it."""
    profile_path = ""

    def start(self, wait: bool = True, timeout: float = 60.0, env: Optional[dict] = None,
              args: tuple[str, ...] = ()) -> "ProfiledBroker":
        self.argv = [sys.executable, "-m", "tgw.bench.profile_broker", "_run-broker", self.profile_path,
                     "start", "--config", self.config_path, "--address", self.address, *args]
        Proc.start(self, env)
        if wait:
            self.wait_ready(timeout)
        return self


def run_profiled_broker(profile_path: str, argv: list[str]) -> None:
    """tgw-broker ARGS; SIGUSR2 opens and closes the window ($TGW_PROFILE_TIMER: split for
    cpu_split's counters; wall or cpu for cProfile on the uvloop thread with that timer)."""
    from tgw.broker.cli.main import main as broker_main
    timer = os.environ.get("TGW_PROFILE_TIMER")
    if timer == "split":
        split = cpu_split.Split()
        split.install()
        signal.signal(signal.SIGUSR2, lambda signum, frame: split.toggle(profile_path))
        return broker_main(argv)
    import cProfile
    prof = cProfile.Profile(time.thread_time) if timer == "cpu" else cProfile.Profile()
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
    broker_main(argv)


def target_for(face: str, c, address: str, model: str, work: str):
    """(the target, its drive) of one face."""
    m = find_model(c.models(), model)
    if face == "native":
        return TgwTarget(address, model, timeout=60.0), loadgen_drive
    if face.startswith("grpc"):
        meta = {"inputs": m["inputs"], "outputs": m["outputs"]}
        cls = GrpcStreamTarget if face == "grpc-stream" else GrpcTarget
        return cls(c.status()["grpc"], model, meta, timeout=60.0), loadgen_drive
    binary = face == "http-binary"
    body, header = v2_body(m, binary)
    path = os.path.join(work, "body.bin" if binary else "body.json")
    with open(path, "wb") as f:
        f.write(body)
    target = v2_target(c.status()["http"], model, path, header, binary, f"tgw HTTP {face[5:]}")
    wrk = shutil.which("wrk")
    return target, (functools.partial(wrk_drive, wrk) if wrk else functools.partial(loadgen_drive,
                                                                                  kind="python-fallback"))


def profile(a: argparse.Namespace) -> dict:
    from tgw.client import Client
    work = tempfile.mkdtemp(prefix="tgwp-", dir="/tmp")
    mode = "split" if a.split else a.cprofile or ""
    prof_path = os.path.join(work, "profile.json" if a.split else "profile.cprofile") if mode else ""
    os.environ["TGW_PROFILE_TIMER"] = mode   # the profiled broker reads it
    cfg = tgw_config(demo_models(os.path.join(work, "models")), [a.model], a.workers)
    srv = ProfiledBroker(cfg, work) if mode else BrokerProc(cfg, work)
    srv.profile_path = prof_path
    srv.start(timeout=180)
    edges: list[dict] = []
    lines: list[str] = []
    try:
        with Client(srv.address) as c:
            processes = c.stats()["processes"]
            pid = next(p["pid"] for p in processes if p["role"] == "broker")
            target, drive_fn = target_for(a.face, c, srv.address, a.model, work)
            toggle = (lambda: os.kill(pid, signal.SIGUSR2)) if mode else (lambda: None)

            def drive(target, spec, on_window_start, on_window_end):
                def start():
                    on_window_start()
                    edges.append(thread_cpu(pid))
                    toggle()

                def end():
                    toggle()
                    edges.append(thread_cpu(pid))
                    on_window_end()
                return drive_fn(target, spec, on_window_start=start, on_window_end=end)
            row = measure(target, LoadSpec("closed", a.concurrency, a.duration, a.warmup, a.procs), processes,
                          stats=c.stats, drive=drive)
    finally:
        code = srv.stop(timeout=30)
    n = row["requests_ok"] + row["requests_failed"]
    us = row["cpu_us_per_request"]
    main_us = (edges[1][pid][1] - edges[0][pid][1]) / n * 1e6
    lines.append(f"{a.face} {a.model} c={a.concurrency}: {row['throughput_rps']:,.0f} req/s, p50 "
                 f"{row['latency_ms']['p50']:.3f} ms, {n:,d} requests, mean batch "
                 f"{row['broker_stats']['mean_batch_rows'] or 0:.1f} rows")
    lines.append(f"CPU us/request: broker {us['broker']:.1f} (main thread {main_us:.1f}), workers {us['workers']:.1f}, "
                 f"generator {us['generator']:.1f}")
    lines.append("broker threads, CPU us/request:")
    threads = sorted(((name, (cpu - edges[0].get(tid, ("", 0.0))[1]) / n * 1e6, tid == pid)
                      for tid, (name, cpu) in edges[1].items()), key=lambda r: -r[1])
    lines += [f"  {v:8.1f}  {name}{' (main)' if main else ''}" for name, v, main in threads if v > 0]
    if mode:
        deadline = time.monotonic() + 30
        while not os.path.exists(prof_path) and time.monotonic() < deadline:
            time.sleep(0.1)
        lines += cpu_split.report(prof_path, n, main_us) if a.split else \
            cpu_split.cprofile_report(prof_path, n, main_us, a.top)
    shutil.rmtree(work, ignore_errors=True)
    return {"command": "python -m tgw.bench.profile_broker " + " ".join(a.argv), "face": a.face, "model": a.model,
            "concurrency": a.concurrency, "throughput_rps": row["throughput_rps"], "latency_ms": row["latency_ms"],
            "mean_batch_rows": row["broker_stats"]["mean_batch_rows"], "cpu_us_per_request": us,
            "main_thread_us_per_request": main_us, "requests": n, "requests_failed": row["requests_failed"],
            "broker_exit": code, "report": lines}


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_run-broker"]:
        run_profiled_broker(argv[1], argv[2:])
        return 0
    if argv[:1] == ["broker"]:   # the retired tool's subcommand (its commands in bench/README.md)
        argv = argv[1:]
    ap = argparse.ArgumentParser(prog="python -m tgw.bench.profile_broker", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add = ap.add_argument
    add("--face", choices=FACES, default="native", help="which face the load comes through (default native)")
    add("--http", choices=("json", "binary"), help="the retired tool's spelling of --face http-json|http-binary")
    add("--model", default="mlp")
    add("--concurrency", type=int, default=64)
    add("--duration", type=float, default=10.0)
    add("--warmup", type=float, default=2.0)
    add("--procs", type=int, default=0, help="generator processes (default: as tgw-bench)")
    add("--workers", type=int, default=os.cpu_count() or 1, help="cpu workers (default: cores)")
    add("--split", action="store_true", help="the main thread's CPU by step (bench/cpu_split.py)")
    add("--cprofile", choices=("wall", "cpu"), help="cProfile the uvloop thread (timer: cProfile's clock or "
                                                    "the thread's CPU time): top functions")
    add("--top", type=int, default=25)
    add("--out", help="also write the result (JSON, with the command and the report) to this file")
    a = ap.parse_args(argv)
    a.argv = argv
    if a.http:
        a.face = f"http-{a.http}"
    try:
        result = profile(a)
    finally:
        stop_all()
    print("\n".join(result["report"]))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["broker_exit"] == 0 and not result["requests_failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
