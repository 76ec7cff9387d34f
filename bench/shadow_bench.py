"""Shadows and guarded rollouts under load (docs/ROLLOUT.md): `--callers` closed-loop callers on the
scorer (bench/shadow_scenarios.py), every answer checked against version 1, on one broker:

  cost      - `--rounds` pairs of phases of `--seconds` each, alternated: off (nothing else) and on
              (a `--fraction` shadow of a version 1e-6 off, no policy, unloaded after the phase);
              the callers' p99 on / off per pair, and off / previous off (the noise);
  promote   - a shadow of another version 1e-6 off with a policy (promote after `--promote-after`
              compared requests, max_abs_diff 1e-4, min_top1_agreement 0.99): promoted;
  rollback  - a shadow of a version whose top-1 flips on 5 % of inputs, same policy: rolled back.
Reported per phase: requests, wrong answers (0 expected), errors, p99 and req/s; for the policy
phases the decision, when, why and with which figures.

    python -m tgw.bench.shadow_bench [--callers 16] [--seconds 6] [--rounds 3] [--promote-after 1000]
        [--out bench/results/shadow-DATE.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import tempfile
import time

from tgw.bench.shadow_scenarios import Callers, control, decision, save_scorer, scorer_decl
from tgw.broker.child import BrokerProc
from tgw.shm.wire import LoadVersion, RolloutPolicy, UnloadVersion, as_builtins


def phase(address: str, model: str, callers: int, seconds: float, load=None) -> dict:
    """Callers for `seconds` (with `load`: from its answer until its decision is carried out, at
    least `seconds`); their figures."""
    c = Callers(address, model, callers, seed=hash(model) % 1000).start()
    time.sleep(1.0)   # warm: every caller connected and answering
    t0 = time.perf_counter()
    out = {}
    if load is not None:
        sent = time.perf_counter()
        control(address, load)
        loaded = time.perf_counter()
        made = decision(address, model, load.version, timeout_s=300)
        decided = time.perf_counter()
        out["decision"] = {**made, "seconds_after_load": round(decided - sent, 3)}
        with c.lock:
            n = sum(1 for end, _ in c.latencies if loaded <= end < decided)
        out["shadow_window"] = {"seconds": round(decided - loaded, 3), "requests": n,
                                "p99_ms": c.p99_ms(loaded, decided)}
    time.sleep(max(0.0, seconds - (time.perf_counter() - t0)))
    t1 = time.perf_counter()
    tally = c.stop()
    out.update(seconds=round(t1 - t0, 2), requests=sum(tally.values()), wrong=tally.get("wrong", 0),
               errors={k[6:]: v for k, v in tally.items() if k.startswith("error ")},
               p99_ms=c.p99_ms(t0, t1), req_per_s=round(sum(1 for end, _ in c.latencies if t0 <= end < t1) / (t1 - t0)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tgw.bench.shadow_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--callers", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--promote-after", type=int, default=1000)
    ap.add_argument("--fraction", type=float, default=0.1)
    ap.add_argument("--out", default=f"bench/results/shadow-{datetime.date.today()}.json")
    a = ap.parse_args(argv)
    policy = RolloutPolicy(promote_after_requests=a.promote_after, min_requests=100, max_abs_diff=1e-4,
                           min_top1_agreement=0.99)
    with tempfile.TemporaryDirectory(prefix="tgwsb-") as d:
        paths = {kind: save_scorer(os.path.join(d, f"{kind}.pt"), kind) for kind in ("base", "close", "flip")}
        cfg = {"model_roots": [d], "models": [scorer_decl("s", paths["base"])],
               "workers": {"devices": ["cpu"], "threads_per_worker": 1, "input_arena_mb": 8, "output_arena_mb": 8}}
        b = BrokerProc(cfg, tempfile.mkdtemp(prefix="tgwsb-", dir="/tmp")).start()
        try:
            cost = []
            for r in range(a.rounds):
                off = phase(b.address, "s", a.callers, a.seconds)
                control(b.address, LoadVersion(v=0, model="s", version=f"c{r}", path=paths["close"],
                                               shadow=a.fraction))
                on = phase(b.address, "s", a.callers, a.seconds)
                control(b.address, UnloadVersion(v=0, model="s", version=f"c{r}"))
                cost.append({"off": off, "on": on, "p99_on_vs_off": _ratio(on["p99_ms"], off["p99_ms"]),
                             "p99_off_vs_previous_off": _ratio(off["p99_ms"], cost[-1]["off"]["p99_ms"])
                             if cost else None})
            decided = {kind: phase(b.address, "s", a.callers, a.seconds, LoadVersion(
                v=0, model="s", version=kind, path=paths["close" if kind == "promote" else "flip"],
                shadow=a.fraction, policy=policy)) for kind in ("promote", "rollback")}
        finally:
            b.stop()
    ratios = sorted(c["p99_on_vs_off"] for c in cost)
    noise = [c["p99_off_vs_previous_off"] for c in cost if c["p99_off_vs_previous_off"] is not None]
    result = {"command": "python -m tgw.bench.shadow_bench " + shlex.join(argv or sys.argv[1:]),
              "callers": a.callers, "fraction": a.fraction,
              "policy": as_builtins(policy),
              "p99_on_vs_off": {"each": [c["p99_on_vs_off"] for c in cost], "median": ratios[len(ratios) // 2]},
              "p99_off_vs_off": noise, "cost": cost, "decided": decided}
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    phases = [c[k] for c in cost for k in ("off", "on")] + list(decided.values())
    ok = decided["promote"]["decision"]["decision"] == "promote" and \
        decided["rollback"]["decision"]["decision"] == "rollback"
    return 0 if ok and not any(p["wrong"] or p["errors"] for p in phases) else 1


def _ratio(a, b):
    return round(a / b, 3) if a and b else None


if __name__ == "__main__":
    sys.exit(main())
