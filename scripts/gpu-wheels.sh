#!/usr/bin/env bash
# Download, into .whl/ (ignored), the wheels that scripts/gpu-check.sh installs on a GPU machine
# with no network: the packages tgw, the GPU tests and the GPU bench import that the machine's
# Python (3.12, x86-64, manylinux) lacks. Run it here, where the package index is reachable, then
# carry .whl to the GPU machine with the checkout. Versions are pinned to the ones .venv holds
# (what the tests pass with here); wheels of other versions are removed, so each package has one.
#
#   bash scripts/gpu-wheels.sh            # PYTHON=... picks the pip that downloads (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."

# The GPU image already has (its package list, /work/.library/device/KINDS.md): numpy, torch,
# uvloop, msgpack, psutil, nvidia-ml-py, pyyaml, aiohttp (and its dependencies),
# prometheus-client, pytest, pytest-timeout, hypothesis, matplotlib, werkzeug, jinja2, click,
# markupsafe, packaging, typing-extensions. tests/unit/test_gpu_scripts.py checks that this list and
# that one cover every import the GPU run needs, and each wheel's own requirements.
# typing-extensions is carried although the image has one: pydantic 2.14 needs >= 4.16, newer
# than an image's may be (a newer one shadows it harmlessly; scripts/gpu-check.sh reports any
# requirement of these wheels that the machine's packages still miss).
PACKAGES=(
    pyzmq msgspec lz4 orjson setproctitle ml_dtypes                # tgw.client / broker / workers
    pydantic pydantic-core annotated-types typing-inspection       # the broker's config schema
    typing-extensions
    flask blinker itsdangerous gunicorn                            # the bench's Flask baseline
    grpcio-health-checking grpcio-reflection                       # the gRPC face (grpcio, protobuf: in the image)
)

venv_python=".venv/bin/python"
[ -x "$venv_python" ] || { echo "gpu-wheels: $venv_python is missing: run scripts/setup-venv.sh dev first" >&2; exit 1; }
pip=("${PYTHON:-python3}" -m pip)

mkdir -p .whl
keep=()
for name in "${PACKAGES[@]}"; do
    version=$("$venv_python" -c 'import sys; from importlib.metadata import version; print(version(sys.argv[1]))' "$name") \
        || { echo "gpu-wheels: $name is not installed in .venv: run scripts/setup-venv.sh dev first" >&2; exit 1; }
    # pure-Python wheels (py3-none-any) match any --platform, so one command serves both kinds
    { "${pip[@]}" download --disable-pip-version-check -q --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
        -d .whl "$name==$version" 2>&1 1>&3 | { grep -v "^WARNING: Location" || true; } >&2; } 3>&1
    stem=$(echo "$name" | tr 'A-Z-.' 'a-z__')          # a wheel file's project name, normalised
    keep+=("${stem}-${version}-")
done

# one version of each: drop every wheel that is not one of those just pinned
for wheel in .whl/*.whl; do
    base=$(basename "$wheel" | tr 'A-Z' 'a-z')
    wanted=no
    for prefix in "${keep[@]}"; do
        [[ "$base" == "$prefix"* ]] && wanted=yes
    done
    if [ "$wanted" = no ]; then
        echo "gpu-wheels: removing $wheel (not pinned now)"
        rm -f -- "$wheel"
    fi
done

count=$(ls .whl/*.whl | wc -l)
[ "$count" -eq "${#PACKAGES[@]}" ] || { echo "gpu-wheels: expected ${#PACKAGES[@]} wheels in .whl, found $count" >&2; exit 1; }
ls -l .whl/*.whl | awk '{printf "  %8.1f KiB  %s\n", $5 / 1024, $9}'
echo "gpu-wheels: $count wheels, $(du -sh .whl | cut -f1) in .whl; carry .whl and run: bash scripts/gpu-check.sh"
