#!/usr/bin/env bash
# Create .venv (if missing) and install tgw with the given extras: scripts/setup-venv.sh server|dev
# torch is pinned to 2.13.0 first: that CPU wheel lies on this machine's disk, and letting pip
# choose freely would download a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-server}"
python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
pip_quiet() { .venv/bin/pip install --disable-pip-version-check -q "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
.venv/bin/python -c "import torch" 2>/dev/null || pip_quiet "torch==2.13.0"
pip_quiet -e ".[${extras}]"
.venv/bin/python -c "import tgw.client, tgw.broker, tgw.workers, torch" \
    || { echo "setup-venv: installation incomplete" >&2; exit 1; }
