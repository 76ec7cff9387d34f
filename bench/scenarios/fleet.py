"""`tgw-bench fleet`: three brokers behind HAProxy, measured (issue 26 "Measured").

Three brokers (one CPU worker each, model "m": version k computes x + k) behind HAProxy
(configs/haproxy/tgw.cfg as the checkout has it, addresses replaced: harness/haproxy.py),
closed-loop HTTP load at c=32 (harness/fleet.py: every answer checked), one phase per scenario
(below, each under load, each returning its figures and whether its goal was met): SIGKILL one
broker mid-run, a rolling restart, scale-up from two to three, scaling (one broker on one core
against two on two), a hot swap v1 -> v2 across the fleet and a hot swap v2 -> v3 behind the
consistent-hash variant (tgw-hash.cfg). Prints one table and writes
bench/results/fleet-<timestamp>[-quick].json. Every process it starts is stopped by its PID at the
end, also on errors, Ctrl-C and SIGTERM. Exit status: 0 every phase ran and every answer was right
(the goals are the table's `met` column), 1 otherwise.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from tgw.bench.harness import subset
from tgw.bench.harness.fleet import HEAVY, MODEL, Load, Member, build_models
from tgw.bench.harness.haproxy import TOTAL, Haproxy
from tgw.bench.harness.report import text_table, write_json

NAME = "fleet"
HELP = "three brokers behind HAProxy: kill, rolling restart, scale-up, scaling, hot swap (own brokers)"
MODES = {"quick": 3.0, "full": 60.0}   # seconds of load per phase
PHASES = ("kill", "rolling", "scale_up", "scaling", "swap", "swap_hash")   # the order they run in
COLUMNS = ("scenario", "requests", "failed", "retried", "figure", "goal", "met")


# ---- the phases, each under closed-loop load through HAProxy (the swaps last: a broker restarted
# after them would come back at v1) -------------------------------------------------------------

STEP_ANSWERS = 200    # answers the load gets between two steps of a phase, so each step is under load


@dataclass
class Fleet:
    work: str
    paths: dict[int, str]
    members: list[Member]
    lb: Haproxy
    seconds: float          # each phase's load
    concurrency: int = 32
    quick: bool = False
    version: int = 1        # what every broker serves now (the swaps move it on)
    started_pids: list[int] = field(default_factory=list)   # HAProxy's of the hash variant

    def load(self, versions: set[int], lb: Haproxy | None = None, model: str = MODEL) -> Load:
        load = Load((lb or self.lb).port, model, self.concurrency, versions).start()
        load.wait_answers(STEP_ANSWERS)
        return load


def until(t: float, load: Load) -> None:
    """Keep the load running until the clock reaches t (the phase's length)."""
    while time.monotonic() < t:
        load.wait_answers(1)
        time.sleep(min(0.05, max(0.0, t - time.monotonic())))


def retried(before: dict, after: dict) -> dict:
    b, a = before[TOTAL], after[TOTAL]
    return {"retries": a["retries"] - b["retries"], "redispatches": a["redispatches"] - b["redispatches"],
            "per_server_2xx": {k: after[k]["2xx"] - before[k]["2xx"] for k in after
                               if k not in (TOTAL, "FRONTEND")}}


def _measured(f: Fleet, versions: set[int], body: Callable[[Load], dict], lb: Haproxy | None = None,
              model: str = MODEL) -> dict:
    lb = lb or f.lb
    before = lb.counters()
    load = f.load(versions, lb, model)
    try:
        extra = body(load)
    finally:
        result = load.stop()
    return {**result, **retried(before, lb.counters()), **(extra(load) if callable(extra) else extra)}


def kill(f: Fleet) -> dict:
    """SIGKILL one broker mid-run; 0 failed, answers never stall longer than the check interval."""
    victim = f.members[1]

    def body(load: Load):
        until(load.t0 + f.seconds / 2, load)
        t_kill = time.monotonic()
        victim.kill()
        down_s = f.lb.wait_status(victim.name, "DOWN")
        until(max(load.t0 + f.seconds, time.monotonic() + 1.0), load)
        return lambda done: {"killed": victim.name, "down_after_s": round(down_s, 3),
                             "longest_stall_s": round(done.longest_stall(t_kill, done.t1) or 0, 3)}
    out = _measured(f, {1}, body)
    victim.start()
    out["back_up_s"] = round(f.lb.wait_status(victim.name, "UP"), 2)
    out["check_interval_s"] = f.lb.inter_s
    out["met"] = out["failed"] == 0 and out["longest_stall_s"] <= f.lb.inter_s
    return out


def rolling(f: Fleet) -> dict:
    """SIGTERM, wait for the exit, start on the same ports, wait ready (and UP), next."""
    def body(load: Load) -> dict:
        steps = []
        for m in f.members:
            rc, stop_s = m.stop()
            t0 = time.monotonic()
            m.start()
            ready_s = time.monotonic() - t0
            up_s = f.lb.wait_status(m.name, "UP")
            steps.append({"broker": m.name, "exit_status": rc, "stop_s": round(stop_s, 2),
                          "start_to_ready_s": round(ready_s, 2), "ready_to_up_s": round(up_s, 2)})
            load.wait_answers(STEP_ANSWERS)
        until(load.t0 + f.seconds, load)
        return {"steps": steps}
    out = _measured(f, {1}, body)
    out["met"] = out["failed"] == 0 and out["dropped"] == 0
    return out


def scale_up(f: Fleet) -> dict:
    """Two brokers serve; a third starts under load and is enabled through the stats socket."""
    new = f.members[2]
    f.lb.set_state(new.name, "maint")
    new.stop()
    window = 10.0

    def body(load: Load) -> dict:
        until(load.t0 + f.seconds / 3, load)
        new.start()
        t_ready = time.monotonic()
        f.lb.set_state(new.name, "ready")
        samples, reached = [], None
        while time.monotonic() < t_ready + window:
            c = f.lb.counters()
            now = (time.monotonic() - t_ready, c[new.name]["2xx"], c[TOTAL]["2xx"])
            # the share over the last second or so (the newest sample at least 1 s older than
            # this one: the stats calls compete with 32 callers for the GIL, so samples are uneven)
            base = next((s for s in reversed(samples) if s[0] <= now[0] - 1.0), None)
            samples.append(now)
            if reached is None and base is not None and now[2] > base[2] \
                    and (now[1] - base[1]) / (now[2] - base[2]) >= 0.25:
                reached = now[0]
            if reached is not None and f.quick and now[0] >= reached + 1.0:
                break
            time.sleep(0.2)
        until(load.t0 + f.seconds, load)
        first, end = samples[0], samples[-1]
        share = (end[1] - first[1]) / max(1, end[2] - first[2])
        return {"new": new.name, "seconds_to_25pct": None if reached is None else round(reached, 2),
                "share_after_ready_pct": round(100 * share, 1), "observed_s": round(end[0], 1)}
    out = _measured(f, {1}, body)
    out["met"] = out["failed"] == 0 and out["seconds_to_25pct"] is not None and out["seconds_to_25pct"] <= window
    return out


def scaling(f: Fleet) -> dict:
    """One broker pinned to core 0, then two (the second's on core 1), behind the same balancer,
    on the compute-bound model (the trivial one measures the load generator and HAProxy)."""
    b1, b2, b3 = f.members
    runs = {}
    try:
        f.lb.set_state(b2.name, "maint")
        f.lb.set_state(b3.name, "maint")
        pinned = {b1.name: b1.pin({0})}
        for n, name in ((1, "one"), (2, "two")):
            if n == 2:
                f.lb.set_state(b2.name, "ready")
                f.lb.wait_status(b2.name, "UP")
                pinned[b2.name] = b2.pin({1})
            cpu0 = f.lb.cpu_s()

            def body(load: Load) -> dict:
                until(load.t0 + f.seconds / 2, load)
                return {}
            r = _measured(f, {1}, body, model=HEAVY)
            r["haproxy_cpu_us_per_request"] = round(1e6 * (f.lb.cpu_s() - cpu0) / max(1, r["ok"]), 1)
            runs[name] = r
    finally:
        for m in f.members:
            m.pin(set(range(_cores())))
        for m in (b2, b3):
            f.lb.set_state(m.name, "ready")
        f.lb.wait_status(b3.name, "UP")
    ratio = runs["two"]["throughput_rps"] / max(runs["one"]["throughput_rps"], 1e-9)
    return {"requests": runs["one"]["requests"] + runs["two"]["requests"],
            "failed": runs["one"]["failed"] + runs["two"]["failed"],
            "retries": runs["one"]["retries"] + runs["two"]["retries"],
            "redispatches": runs["one"]["redispatches"] + runs["two"]["redispatches"],
            "ratio": round(ratio, 2), "runs": runs, "pinned_pids": pinned,
            "cores": _cores(), "met": ratio >= 1.7}


def swap(f: Fleet, lb: Haproxy | None = None) -> dict:
    """v`old` -> v`new` (the next) on each broker in turn, spread over the phase; replies only of
    the two."""
    old, new = f.version, f.version + 1
    def body(load: Load) -> dict:
        swaps = []
        for i, m in enumerate(f.members, 1):
            until(load.t0 + f.seconds * i / (len(f.members) + 1), load)
            swaps.append(m.load_version(new, f.paths[new]))
            load.wait_answers(STEP_ANSWERS)
        until(load.t0 + f.seconds, load)
        return {"swaps": swaps}
    out = _measured(f, {old, new}, body, lb)
    f.version = new
    out.update(old=old, new=new)
    # behind leastconn a key moves between boxes, so it may meet v`old` after v`new`: only the
    # hash variant promises otherwise (swap_hash)
    out["met"] = out["failed"] == 0 and set(out["by_version"]) <= {str(old), str(new)}
    return out


def swap_hash(f: Fleet) -> dict:
    """The same swap behind the consistent-hash variant: no routing key sees the new version
    and then the old one."""
    lb = Haproxy(f.work, [m.server for m in f.members], hash_key=True).start()
    try:
        for m in f.members:
            lb.wait_status(m.name, "UP")
        out = swap(f, lb)
        out["haproxy_config"] = lb.origin
        out["met"] = out["met"] and out["backward_count"] == 0
        return out
    finally:
        f.started_pids.append(lb.pid)
        lb.stop()


def _cores() -> int:
    return os.cpu_count() or 1


# ---- the run ---------------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help=f"{MODES['quick']:g} s per phase instead of "
                                                        f"{MODES['full']:g} s")
    p.add_argument("--concurrency", type=int, default=32, help="callers in flight (default 32)")
    p.add_argument("--phases", type=subset(PHASES), default=list(PHASES),
                   help=f"comma-separated subset of {','.join(PHASES)}, run in that order (default: all)")
    p.add_argument("--json", metavar="FILE", help="default: bench/results/fleet-<timestamp>[-quick].json")
    p.add_argument("--keep", action="store_true", help="keep the work folder (configs, logs)")


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


def run(a: argparse.Namespace) -> int:
    mode = "quick" if a.quick else "full"
    work = tempfile.mkdtemp(prefix="tgwfleet-", dir="/tmp")   # short: ipc socket paths have a length limit
    results: dict[str, dict] = {}
    members: list[Member] = []
    lb: Optional[Haproxy] = None
    info: dict[str, Any] = {}
    fleet: Optional[Fleet] = None
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
        fleet = Fleet(work, paths, members, lb, MODES[mode], a.concurrency, a.quick)
        steps = {"kill": kill, "rolling": rolling, "scale_up": scale_up, "scaling": scaling,
                 "swap": swap, "swap_hash": swap_hash}
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
    out = a.json or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results",
                                 f"fleet-{time.strftime('%Y%m%d-%H%M%S')}{'-quick' if a.quick else ''}.json")
    write_json(out, {"command": a.command_line, "mode": mode, "seconds_per_phase": MODES[mode],
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
