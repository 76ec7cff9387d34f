"""The guarded rollout of docs/ROLLOUT.md, start to finish, as an operator types it: a broker on the
scorer (bench/shadow_scenarios.py) with 8 callers; a shadow that flips top-1 on 5 % of inputs is
loaded with a policy (rolled back), then one 1e-6 off (promoted); `models diff` and `models list`
between. Prints each command and its output, the callers' tally and the broker's rollout log lines.

    python -m tgw.bench.rollout_walkthrough > bench/results/rollout-walkthrough-DATE.txt
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import time

from tgw.bench.shadow_scenarios import Callers, decision, save_scorer, scorer_decl
from tgw.broker.child import BrokerProc

POLICY = ["--policy", "promote_after_requests=2000", "min_requests=200", "max_abs_diff=1e-4", "min_top1_agreement=0.99"]


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="tgwwalk-") as d:
        paths = {k: save_scorer(f"{d}/{k}.pt", k) for k in ("base", "close", "flip")}
        cfg = {"model_roots": [d], "models": [scorer_decl("scorer", paths["base"])],
               "workers": {"devices": ["cpu"], "threads_per_worker": 1, "input_arena_mb": 8, "output_arena_mb": 8}}
        b = BrokerProc(cfg, tempfile.mkdtemp(prefix="tgwwalk-", dir="/tmp")).start()

        def run(*args: str) -> None:
            r = subprocess.run([sys.executable, "-m", "tgw.broker", *args, "--address", b.address],
                               capture_output=True, text=True, timeout=120)
            print(f"$ tgw-broker {' '.join(args)}\n{r.stdout}{r.stderr}".replace(d, "/models"))
        try:
            print("# python -m tgw.bench.rollout_walkthrough: 8 callers on scorer version 1 throughout")
            callers = Callers(b.address, "scorer", 8).start()
            time.sleep(2)
            run("models", "load", "scorer", "--version", "2", "--path", paths["flip"], "--shadow", "0.1", *POLICY)
            decision(b.address, "scorer", "2")
            run("models", "diff", "scorer")
            run("models", "list")
            run("models", "load", "scorer", "--version", "3", "--path", paths["close"], "--shadow", "0.1", *POLICY)
            time.sleep(1)
            run("models", "diff", "scorer")
            decision(b.address, "scorer", "3")
            run("models", "diff", "scorer")
            run("models", "list")
            print(f"# the callers' answers, each checked against version 1 within 1e-4: {callers.stop()}")
        finally:
            b.stop()
        print("# the broker's log lines of the rollouts:")
        print("\n".join(line for line in b.output().splitlines() if "rollout of" in line or "as a shadow" in line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
