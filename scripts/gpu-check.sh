#!/usr/bin/env bash
# GPU checks for a machine with CUDA: the GPU tests, then the quick benchmark. Prints a summary.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh dev >/dev/null
.venv/bin/python -c "import torch; print('cuda', torch.cuda.is_available(), torch.cuda.device_count())"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
.venv/bin/python -m pytest -q -p no:cacheprovider -m gpu tests/ ; tests=$?
.venv/bin/python bench/compare.py --quick ; bench=$?
echo "gpu-check: tests exit $tests, bench exit $bench"
exit $(( tests || bench ))
