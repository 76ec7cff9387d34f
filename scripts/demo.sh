#!/usr/bin/env bash
# The main job on the embedded demo: set up, start the broker, send real traffic to every demo
# model (native socket and KServe v2 HTTP), stream from its generator tiny-gpt (native client, sync
# and async; tritonclient's gRPC stream, HTTP generate_stream, the openai client), step its sequence
# model over three faces, check each answer and each sequence against the model run in-process,
# print tables, stop, check /dev/shm.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh demo
run_dir=$(mktemp -d /tmp/tgw-demo.XXXXXX)
address="ipc://${run_dir}/tgw.sock"
log="${run_dir}/broker.log"
export TGW_DEMO_DIR="${TGW_DEMO_DIR:-$HOME/.cache/tgw/demo}"

.venv/bin/tgw-broker start --address "$address" --http-port 0 --grpc-port 0 >"$log" 2>&1 &
broker=$!
cleanup() { kill -TERM "$broker" 2>/dev/null && wait "$broker" 2>/dev/null; rm -rf "$run_dir"; }
trap cleanup EXIT

status=0
.venv/bin/python scripts/demo_traffic.py --address "$address" --requests "${TGW_DEMO_REQUESTS:-300}" \
    --models-dir "$TGW_DEMO_DIR" --broker-pid "$broker" || status=$?

kill -TERM "$broker"
wait "$broker" || { echo "broker exited non-zero on SIGTERM; its log:" >&2; cat "$log" >&2; status=1; }
trap - EXIT
left=$(ls /dev/shm | grep -E "^tgw_[a-z]+_${broker}_" || true)
if [ -n "$left" ]; then
    echo "FAIL: left in /dev/shm after stop: $left" >&2
    status=1
else
    echo "/dev/shm: clean after stop"
fi
rm -rf "$run_dir"
exit "$status"
