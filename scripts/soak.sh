#!/usr/bin/env bash
# Steady open-loop load at 70% of the measured capacity on a broker of its own:
#   scripts/soak.sh --minutes N      (or --seconds S for a short run)
# Prints each process's RSS, open fds and threads before and after, requests sent / OK / errors
# by code, latency p50/p99; exits non-zero if a request failed or a process died (tests/tools/soak.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh server
PYTHONPATH=tests exec .venv/bin/python -m tools.soak "$@"   # a test tool: it lives in tests/tools/
