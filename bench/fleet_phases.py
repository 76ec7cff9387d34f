"""The fleet's scenarios (issue 26 "Measured"), each under closed-loop load through HAProxy,
each returning its figures and whether its goal was met. bench/fleet.py runs them in order on
one fleet: kill, rolling restart, scale-up, scaling, hot swap, hot swap behind the hash variant
(the swaps last: a broker restarted after them would come back at v1).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from tgw.bench.fleet_haproxy import TOTAL, Haproxy
from tgw.bench.fleet_load import Load
from tgw.bench.fleet_members import HEAVY, MODEL, Member

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
    import os
    return os.cpu_count() or 1
