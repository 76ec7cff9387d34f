"""scripts/gpu-check.sh and scripts/gpu-wheels.sh run without a GPU: both parse (`bash -n`);
gpu-check.sh's verdict (`--summary`, on a run's files) is OK only when a GPU test passed, never
where every one skipped; and `tgw-bench gpu --help` runs. (What the wheels cover:
tests/unit/test_gpu_scripts.py.)"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECK, WHEELS = (os.path.join(ROOT, "scripts", name) for name in ("gpu-check.sh", "gpu-wheels.sh"))


@pytest.mark.parametrize("script", [CHECK, WHEELS])
def test_scripts_parse(script):
    r = subprocess.run(["bash", "-n", script], capture_output=True, text=True, timeout=10)
    assert r.returncode == 0 and r.stderr == "", r.stderr     # no syntax error, nor a warning


def test_gpu_bench_help():
    out = subprocess.run([sys.executable, "-m", "tgw.bench.cli", "gpu", "--help"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "--device" in out.stdout and "--quick" in out.stdout and "--json" in out.stdout


# ---- gpu-check.sh's verdict: OK only when a GPU test passed ----------------------------------

def check_summary(out, tests_exit: int, bench_exit: int = 0) -> subprocess.CompletedProcess:
    """`gpu-check.sh --summary` on a run's files in `out`, with these exit statuses of its steps."""
    (out / "exits.txt").write_text(f"tests={tests_exit}\nfiles=tests/...\nbench={bench_exit}\n")
    return subprocess.run(["bash", CHECK, "--summary"], env={**os.environ, "OUT": str(out), "PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=60)


def gpu_tests(out, cwd, *files: str) -> int:
    """pytest -m gpu on `files` as gpu-check.sh runs it, its junit report in `out`; its exit status."""
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-rs",
                           f"--junitxml={out / 'tests.xml'}", *files], cwd=cwd, capture_output=True, text=True,
                          timeout=120).returncode


def test_gpu_check_is_not_ok_where_every_gpu_test_skipped(tmp_path):
    """This machine's own run of a GPU test file: without CUDA every test skips, and that is no GPU check."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("CUDA is here: the GPU tests run")
    assert gpu_tests(tmp_path, ROOT, "tests/inproc/test_worker_loop.py") == 0   # pytest itself is content with skips
    r = check_summary(tmp_path, 0)
    lines = r.stdout.strip().splitlines()
    assert r.returncode != 0, r.stdout
    assert lines[-1] == "gpu-check: FAILED (no GPU test passed)"
    assert "gpu-check: no GPU test passed (no CUDA device x4)" in lines
    assert "tests: 0 passed, 0 failed, 0 errors, 4 skipped (pytest exit 0; tests/...)" in lines
    assert (tmp_path / "summary.txt").read_text() == r.stdout


FAKE_GPU_TESTS = """
import pytest

@pytest.mark.gpu
def test_on_the_gpu():
    pass

@pytest.mark.gpu
@pytest.mark.skipif(True, reason="no CUDA device")
def test_skipped():
    pass
"""


@pytest.mark.parametrize("bench_exit, verdict", [(0, "gpu-check: OK"), (1, "gpu-check: FAILED (bench exit 1)")])
def test_gpu_check_is_ok_once_a_gpu_test_passed_and_the_bench_did(tmp_path, bench_exit, verdict):
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a CUDA device\n")
    (tmp_path / "test_fake_gpu.py").write_text(FAKE_GPU_TESTS)
    assert gpu_tests(tmp_path, tmp_path, "test_fake_gpu.py") == 0
    r = check_summary(tmp_path, 0, bench_exit)
    assert r.stdout.strip().splitlines()[-1] == verdict and (r.returncode == 0) == (bench_exit == 0), r.stdout
    assert "tests: 1 passed, 0 failed, 0 errors, 1 skipped" in r.stdout


def test_gpu_check_without_a_test_report_is_not_ok(tmp_path):
    r = check_summary(tmp_path, 5)
    assert r.returncode != 0
    assert r.stdout.strip().splitlines()[-1] == "gpu-check: FAILED (tests exit 5, no junit report)"
