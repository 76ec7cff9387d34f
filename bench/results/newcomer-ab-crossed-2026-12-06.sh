#!/usr/bin/env bash
# Issue 39, crossed A/B: each broker (before: be9f380, after) serves each side's tgw-bench load client, mlp c=1, 4 s, three rounds;
# the per-run JSON files land in OUT (summarised into newcomer-ab-crossed-2026-12-06.json).
#   bash bench/results/newcomer-ab-crossed-2026-12-06.sh BEFORE_TREE AFTER_TREE OUT_DIR
set -u
before=$1 after=$2 out=$3; mkdir -p "$out"
for round in 1 2 3; do
for b in before after; do
  btree=$after; [ $b = before ] && btree=$before
  addr=ipc://$out/$b.sock
  $btree/.venv/bin/tgw-broker start --address $addr --log-level WARNING > $out/$b-$round.log 2>&1 &
  pid=$!
  $btree/.venv/bin/python - $addr <<'PY'
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
        if time.monotonic() > deadline: raise
        time.sleep(0.2)
PY
  for c in before after; do
    ctree=$after; [ $c = before ] && ctree=$before
    $ctree/.venv/bin/tgw-bench load --address $addr --model mlp --concurrency 1 --duration 4 --warmup 1 --json $out/b$b-c$c-$round.json > /dev/null 2>&1
  done
  kill -TERM $pid; wait $pid
done
done
