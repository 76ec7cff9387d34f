#!/usr/bin/env bash
# Hostile frames at a broker of its own, with checked valid requests in between:
#   scripts/fuzz.sh [--count N] [--threads T] [--seed S]    (default 100,000 frames)
# Prints replies by code, frames without reply by category, the broker's RSS, tracebacks in its
# log; exits non-zero if a valid request failed or mismatched, the broker died or logged a
# traceback (tests/tools/fuzz.py's docstring says exactly what is counted).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh server
PYTHONPATH=tests exec .venv/bin/python -m tools.fuzz "$@"   # a test tool: it lives in tests/tools/
