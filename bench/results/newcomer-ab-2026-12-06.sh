#!/usr/bin/env bash
# Issue 39 A/B (the command behind newcomer-ab-2026-12-06.json): the whole system before issue 39
# (be9f380, checked out at BEFORE with its own .venv) and after it (AFTER): each side's own
# tgw-bench load (its AsyncClient: after issue 39 it holds requests beyond the broker's cap) against
# its own broker on the embedded demo's mlp, c=1 and c=64, alternated six times; load starts only
# once an inference succeeds. Summarised by bench/results/newcomer-ab-summary.py.
#   bash bench/results/newcomer-ab-2026-12-06.sh BEFORE_TREE AFTER_TREE OUT_DIR
set -uo pipefail
before=$1 after=$2 out=$3
mkdir -p "$out"
for round in 1 2 3 4 5 6; do
  for side in before after; do
    tree=$after; [ "$side" = before ] && tree=$before
    addr=ipc://$out/$side.sock
    "$tree/.venv/bin/tgw-broker" start --address "$addr" --log-level WARNING > "$out/$side-$round.log" 2>&1 &
    pid=$!
    "$tree/.venv/bin/python" - "$addr" <<'PY'
import sys, time
import numpy as np
from tgw.client import Client, TgwError
deadline = time.monotonic() + 120
while True:
    try:
        with Client(sys.argv[1]) as c:
            c.infer("mlp", {"x": np.zeros((1, 256), np.float32)}, timeout=2.0)
        break
    except (TgwError, OSError):
        if time.monotonic() > deadline:
            raise
        time.sleep(0.2)
PY
    "$tree/.venv/bin/tgw-bench" load --address "$addr" --model mlp --concurrency 1,64 --duration 5 --warmup 1 \
        --json "$out/$side-$round.json" > "$out/$side-$round.txt" 2>&1
    kill -TERM "$pid"; wait "$pid"
  done
done
# the summary: per side and concurrency, each round's figures and their medians
"$after/.venv/bin/python" - "$out" <<'PY'
import json, statistics, sys
out = sys.argv[1]
runs = {"before": {}, "after": {}}
for side in runs:
    for rnd in range(1, 7):
        for r in json.load(open(f"{out}/{side}-{rnd}.json"))["runs"]:
            runs[side].setdefault(r["level"], []).append(
                {"req_s": r["throughput_rps"], "p50_ms": round(r["latency_ms"]["p50"], 3),
                 "p99_ms": round(r["latency_ms"]["p99"], 3), "errors": r["requests_failed"],
                 "broker_cpu_us_per_request": round(r["cpu_us_per_request"]["broker"], 1),
                 "client_cpu_us_per_request": round(r["cpu_us_per_request"]["generator"], 1)})
med = {side: {c: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for c, rs in levels.items()}
       for side, levels in runs.items()}
ratios = {c: {k: round(med["after"][c][k] / med["before"][c][k], 3) for k in ("req_s", "p50_ms", "p99_ms",
          "broker_cpu_us_per_request", "client_cpu_us_per_request")} for c in med["after"]}
print(json.dumps({"runs": runs, "medians": med, "after_over_before": ratios}, indent=1))
PY
