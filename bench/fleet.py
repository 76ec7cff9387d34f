"""`tgw-bench fleet`: three brokers behind HAProxy, measured (issue 26 "Measured").

Three brokers (one CPU worker each, model "m": version k computes x + k) behind HAProxy
(configs/haproxy/tgw.cfg as the checkout has it, addresses replaced: bench/fleet_haproxy.py),
closed-loop HTTP load at c=32 (bench/fleet_load.py: every answer checked), one phase per
scenario (bench/fleet_phases.py): SIGKILL one broker mid-run, a rolling restart, scale-up from
two to three, scaling (one broker on one core against two on two), a hot swap v1 -> v2 across
the fleet and a hot swap v2 -> v3 behind the consistent-hash variant (tgw-hash.cfg). Prints
one table and writes bench/results/fleet-<timestamp>[-quick].json. Every process it starts
is stopped by its PID at the end, also on errors, Ctrl-C and SIGTERM. Exit status: 0 every
phase ran and every answer was right (the goals are the table's `met` column), 1 otherwise.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import traceback
from typing import Any, Optional

from tgw.bench import fleet_phases as ph
from tgw.bench.fleet_haproxy import Haproxy
from tgw.bench.fleet_members import Member, build_models
from tgw.bench.report import text_table, write_json
from tgw.bench.selfhosted import subset

MODES = {"quick": 3.0, "full": 60.0}   # seconds of load per phase
PHASES = ("kill", "rolling", "scale_up", "scaling", "swap", "swap_hash")   # the order they run in
COLUMNS = ("scenario", "requests", "failed", "retried", "figure", "goal", "met")


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("fleet", help="three brokers behind HAProxy: kill, rolling restart, scale-up, scaling, "
                                     "hot swap (own brokers)", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"{MODES['quick']:g} s per phase instead of "
                                                        f"{MODES['full']:g} s")
    p.add_argument("--concurrency", type=int, default=32, help="callers in flight (default 32)")
    p.add_argument("--phases", type=subset(PHASES), default=list(PHASES),
                   help=f"comma-separated subset of {','.join(PHASES)}, run in that order (default: all)")
    p.add_argument("--json", metavar="FILE", help="default: bench/results/fleet-<timestamp>[-quick].json")
    p.add_argument("--keep", action="store_true", help="keep the work folder (configs, logs)")
    return p


def _row(name: str, r: dict, figure: str, goal: str) -> list[str]:
    retried = r.get("retries", 0) + r.get("redispatches", 0)
    return [name, str(r["requests"]), str(r["failed"]), str(retried), figure, goal, "yes" if r["met"] else "NO"]


def table(results: dict[str, dict], inter_s: float) -> list[list[str]]:
    rows: list[list[str]] = [list(COLUMNS)]
    ok = {name: r for name, r in results.items() if "error" not in r}
    k = ok.get("kill")
    if k:
        rows.append(_row("SIGKILL one broker", k, f"longest stall {1000 * k['longest_stall_s']:.0f} ms, "
                                                  f"DOWN after {k['down_after_s']:.2f} s",
                         f"0 failed, stall <= {1000 * inter_s:.0f} ms"))
    r = ok.get("rolling")
    if r:
        rows.append(_row("rolling restart x3", r, f"{r['dropped']} dropped, errors {r['errors'] or '{}'}",
                         "0 failed, 0 dropped"))
    s = ok.get("swap")
    if s:
        rows.append(_row(f"hot swap v{s['old']}->v{s['new']} (leastconn)", s, f"by version {s['by_version']}",
                         f"0 failed, versions in {{{s['old']},{s['new']}}}"))
    h = ok.get("swap_hash")
    if h:
        rows.append(_row(f"hot swap v{h['old']}->v{h['new']} (hash key)", h,
                         f"keys back to v{h['old']}: {h['backward_count']}, by version {h['by_version']}",
                         f"0 failed, no key v{h['new']} then v{h['old']}"))
    u = ok.get("scale_up")
    if u:
        reached = "never" if u["seconds_to_25pct"] is None else f"after {u['seconds_to_25pct']:.1f} s"
        rows.append(_row("scale up 2 -> 3", u, f"new one >= 25 % {reached} "
                                               f"({u['share_after_ready_pct']:.0f} % over {u['observed_s']:g} s)",
                         ">= 25 % within 10 s"))
    c = ok.get("scaling")
    if c:
        one, two = c["runs"]["one"], c["runs"]["two"]
        rows.append(_row("scaling 1 -> 2 pinned", c, f"{c['ratio']:.2f}x ({one['throughput_rps']:.0f} -> "
                                                     f"{two['throughput_rps']:.0f} req/s), haproxy "
                                                     f"{two['haproxy_cpu_us_per_request']:.0f} us CPU/req",
                         ">= 1.7x"))
    for name, r in results.items():
        if name not in ok:
            rows.append([name, "-", "-", "-", r["error"][:80], "-", "NO"])
    return rows


def run(a: argparse.Namespace, command_line: str = "tgw-bench fleet") -> int:
    mode = "quick" if a.quick else "full"
    work = tempfile.mkdtemp(prefix="tgwfleet-", dir="/tmp")   # short: ipc socket paths have a length limit
    results: dict[str, dict] = {}
    members: list[Member] = []
    lb: Optional[Haproxy] = None
    info: dict[str, Any] = {}
    fleet: Optional[ph.Fleet] = None
    t_start, load_before = time.monotonic(), os.getloadavg()
    try:
        paths = build_models(work)
        members = [Member(f"b{i}", work, paths, heavy="scaling" in a.phases) for i in (1, 2, 3)]
        for m in members:
            m.start(wait=False)
        for m in members:
            m.wait_ready()
        lb = Haproxy(work, [m.server for m in members]).start()
        for m in members:
            lb.wait_status(m.name, "UP")
        info = {"haproxy_config": lb.origin, "haproxy_changes": lb.changes, "check_interval_s": lb.inter_s,
                "ports": {m.name: m.port for m in members}, "haproxy_port": lb.port}
        fleet = ph.Fleet(work, paths, members, lb, MODES[mode], a.concurrency, a.quick)
        steps = {"kill": ph.kill, "rolling": ph.rolling, "scale_up": ph.scale_up, "scaling": ph.scaling,
                 "swap": ph.swap, "swap_hash": ph.swap_hash}
        for name in [p for p in PHASES if p in a.phases]:
            step = steps[name]
            t0 = time.monotonic()
            try:
                results[name] = step(fleet)
            except Exception as exc:  # noqa: BLE001 - recorded; the later phases need a whole fleet
                results[name] = {"error": f"{type(exc).__name__}: {exc}", "met": False,
                                 "traceback": traceback.format_exc()}
                print(f"fleet: {name} failed: {results[name]['error']}", flush=True)
                break
            results[name]["wall_s"] = round(time.monotonic() - t0, 1)
            print(f"fleet: {name} done in {results[name]['wall_s']} s", flush=True)
    finally:
        if lb is not None:
            lb.stop()
        for m in members:
            m.stop()
        pids = [p for m in members for p in m.started_pids] + ([lb.pid] if lb and lb.pid else []) + \
            (fleet.started_pids if fleet else [])
        info["started_pids"] = pids   # all stopped by now (tests/process/test_fleet.py checks)
        info["stopped_at"] = time.time()
        if a.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    rows = table(results, info.get("check_interval_s", 0.5))
    print(text_table(rows))
    out = a.json or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                 f"fleet-{time.strftime('%Y%m%d-%H%M%S')}{'-quick' if a.quick else ''}.json")
    write_json(out, {"command": command_line, "mode": mode, "seconds_per_phase": MODES[mode],
                     "concurrency": a.concurrency, "cores": os.cpu_count(), "wall_s": round(time.monotonic() - t_start, 1),
                     "load_average": {"before": load_before, "after": os.getloadavg()},
                     "note": "the load generator, HAProxy and the three brokers share this machine's cores",
                     **info, "table": rows, "results": results})
    print(f"wrote {out}")
    return 0 if len(results) == len(a.phases) and not any(wrong_answers(r) for r in results.values()) else 1


def wrong_answers(r: dict) -> int:
    """A phase that errored, or answers that were wrong: a version outside the phase's, a wrong
    output, a key going back a version behind the hash variant. (Goals are the table's `met`.)"""
    runs = list(r.get("runs", {}).values()) or [r]
    return int("error" in r) + sum(x.get("errors", {}).get("WRONG_ANSWER", 0) for x in runs) + \
        (r.get("backward_count", 0) if r.get("haproxy_config") else 0)
