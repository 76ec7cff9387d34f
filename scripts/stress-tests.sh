#!/usr/bin/env bash
# Run the whole test suite N times while every core is kept busy by a background spinner, and
# print pass/fail per run: a test that fails now and then on a loaded machine shows up here.
#   scripts/stress-tests.sh [N=5] [extra pytest arguments]
set -uo pipefail
cd "$(dirname "$0")/.."
runs="${1:-5}"
shift || true
bash scripts/setup-venv.sh dev || exit 1
logs=$(mktemp -d /tmp/tgw-stress-XXXXXX)

# one busy-looping process per core; killed by PID when this script ends, however it ends
spinners=()
for _ in $(seq "$(nproc)"); do
    .venv/bin/python -c "while True: pass" &
    spinners+=($!)
done
trap 'kill "${spinners[@]}" 2>/dev/null; wait "${spinners[@]}" 2>/dev/null' EXIT

passed=0
for i in $(seq "$runs"); do
    start=$(date +%s)
    if .venv/bin/python -m pytest -q -p no:cacheprovider "$@" >"$logs/run-$i.log" 2>&1; then
        verdict=pass
        passed=$((passed + 1))
    else
        verdict=FAIL
    fi
    printf 'run %d/%d: %s in %ds (%s)\n' "$i" "$runs" "$verdict" "$(( $(date +%s) - start ))" \
        "$(tail -n 1 "$logs/run-$i.log")"
    [ "$verdict" = pass ] || grep -E '^(FAILED|ERROR) ' "$logs/run-$i.log" | sed 's/^/    /'
done
echo "stress: $passed of $runs runs passed with $(nproc) busy spinner(s); logs in $logs"
[ "$passed" -eq "$runs" ]
