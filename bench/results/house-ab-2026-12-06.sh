#!/usr/bin/env bash
# Issue 38 A/B (the command behind house-ab-2026-12-06.json): one client, tgw-bench load of the
# tree after issue 38, against the broker of the tree before it (039767d, checked out at BEFORE)
# and after it (AFTER), the embedded demo's mlp, alternated three times; each broker is sent load
# only once an inference succeeds (every worker ready).
#   bash bench/results/house-ab-2026-12-06.sh BEFORE_TREE AFTER_TREE OUT_DIR
set -uo pipefail
before=$1 after=$2 out=$3
mkdir -p "$out"
for round in 1 2 3; do
  for side in before after; do
    tree=$after; [ "$side" = before ] && tree=$before
    addr=ipc://$out/$side.sock
    "$tree/.venv/bin/tgw-broker" start --address "$addr" --log-level WARNING > "$out/$side-$round.log" 2>&1 &
    pid=$!
    "$after/.venv/bin/python" - "$addr" <<'PY'
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
    "$after/.venv/bin/tgw-bench" load --address "$addr" --model mlp --concurrency 1,64 --duration 5 --warmup 1 \
        --json "$out/$side-$round.json" > "$out/$side-$round.txt" 2>&1
    kill -TERM "$pid"; wait "$pid"
  done
done
