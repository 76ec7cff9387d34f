#!/usr/bin/env bash
# The test command: installs tgw[dev] into .venv, then runs the whole suite (short mode).
# TGW_SLOW=1 runs the slow suites in full; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh dev
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
