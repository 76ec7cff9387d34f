#!/usr/bin/env bash
# The test command: installs tgw[dev] into .venv, then runs the whole suite (short mode).
# TGW_SLOW=1 runs the slow suites in full; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh dev
# The balancer recipes' tests (tests/*/test_recipe*.py) run HAProxy and nginx: install Debian's
# packages when missing and we may (root, or sudo without a password); else those tests skip.
missing=()
for tool in haproxy nginx; do
    command -v "$tool" >/dev/null || [ -x "/usr/sbin/$tool" ] || missing+=("$tool")
done
if [ ${#missing[@]} -gt 0 ]; then
    as_root=()
    [ "$(id -u)" = 0 ] || as_root=(sudo -n)
    if { [ ${#as_root[@]} = 0 ] || sudo -n true 2>/dev/null; } && command -v apt-get >/dev/null \
        && "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -qq update >/dev/null 2>&1 \
        && "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -qq install -y --no-install-recommends \
            "${missing[@]}" >/dev/null 2>&1; then
        echo "test.sh: installed ${missing[*]} (apt-get)"
    else
        echo "test.sh: apt-get could not install ${missing[*]} (it needs root or passwordless sudo, and the package index); their recipe tests will skip" >&2
    fi
fi
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=20 "$@"
