"""Triton's own Python client examples (tests/data/triton-client-examples/, copied unchanged from
triton-inference-server/client) run as subprocesses against one broker serving a Triton
repository of stand-in models (tgw.testing.triton_repo, served with `tgw-broker start --model-repository`): each must exit 0 and print its PASS line
(or, for the examples that print none, its last check's output)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import pytest

from tgw.client import Client
from tgw.shm.segment import list_segments
from tgw.testing.child import BrokerProc
from tgw.testing import triton_repo

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "data", "triton-client-examples")


@pytest.fixture(scope="module")
def broker():
    d = os.path.realpath(tempfile.mkdtemp(prefix="tgwte-", dir="/tmp"))   # ipc paths must stay short
    repo = os.path.join(d, "repo")
    triton_repo.write(repo)
    cfg = {"http": {"port": 0, "allow_client_shm": True}, "grpc": {"port": 0, "allow_client_shm": True},
           "workers": {"devices": ["cpu"], "threads_per_worker": 1, "input_arena_mb": 8, "output_arena_mb": 4,
                       "stage_workers": 1}}
    b = BrokerProc(cfg, d).start(args=("--model-repository", repo), timeout=120)
    with Client(b.address) as c:
        b.http, b.grpc = c.status()["http"], c.status()["grpc"]
    yield b
    code = b.stop()
    shutil.rmtree(d, ignore_errors=True)
    assert code == 0, f"broker exited {code} on SIGTERM:\n{b.output()}"
    assert not list_segments(b.proc.pid), "segments left in /dev/shm after a clean stop"


def run(example: str, *args: str) -> str:
    """The example run as its user would; its output, after checking it exited 0."""
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, example), *args], capture_output=True,
                          text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{example} {' '.join(args)} exited {proc.returncode}:\n{out[-3000:]}"
    return out


def http(b) -> tuple[str, str]:
    return "-u", b.http.removeprefix("http://")


def grpc(b) -> tuple[str, str]:
    return "-u", b.grpc


SIMPLE = [   # (example, face, what its output shows when it passed, its other flags)
    ("simple_http_infer_client.py", http, "Request for unknown model"),
    ("simple_grpc_infer_client.py", grpc, "PASS: infer"),
    ("simple_http_async_infer_client.py", http, "15 - 1 = 14"),
    ("simple_grpc_async_infer_client.py", grpc, "PASS: Async infer"),
    ("simple_http_health_metadata.py", http, "'name': 'simple'"),
    ("simple_grpc_health_metadata.py", grpc, "name: \"simple\""),
    ("simple_http_string_infer_client.py", http, "PASS: string"),
    ("simple_grpc_string_infer_client.py", grpc, "PASS: string"),
    ("simple_http_shm_client.py", http, "PASS: system shared memory"),
    ("simple_grpc_shm_client.py", grpc, "PASS: system shared memory"),
    ("simple_http_shm_string_client.py", http, "PASS: system shared memory"),
    ("simple_grpc_shm_string_client.py", grpc, "PASS: system shared memory"),
    # run at once, so each its own sequence ids (its --offset, as Triton's QA runs them)
    ("simple_grpc_sequence_sync_infer_client.py", grpc, "PASS: Sequence", "-o", "0"),
    ("simple_http_sequence_sync_infer_client.py", http, "PASS: Sequence", "-o", "1"),
    ("simple_grpc_sequence_stream_infer_client.py", grpc, "PASS: Sequence", "-o", "2"),
]


def test_simple_examples(broker):
    """Each example its own process, four at a time (each mostly waits on imports and the broker);
    the shared-memory ones one after another: each begins by unregistering every region, and
    they share region names."""
    def one(case) -> str | None:
        example, face, passed, *flags = case
        try:
            out = run(example, *face(broker), *flags)
        except AssertionError as exc:
            return str(exc)
        return None if passed in out else f"{example}: no {passed!r} in its output:\n{out[-2000:]}"

    def in_turn(cases) -> list[str]:
        return [f for f in map(one, cases) if f]
    shm = [c for c in SIMPLE if "_shm_" in c[0]]
    groups = [shm] + [[c] for c in SIMPLE if c not in shm]
    with ThreadPoolExecutor(4) as pool:
        failed = [f for found in pool.map(in_turn, groups) for f in found]
    assert not failed, "\n\n".join(failed)


def test_image_client(broker, tmp_path):
    """image_client.py over both protocols, on a batched NCHW model and a max_batch_size-0 NHWC one,
    its top-k through the classification extension with the model's labels."""
    picture = triton_repo.image(str(tmp_path / "picture.jpg"))
    answers = []
    for model, face, protocol in [("image_cnn", http, "HTTP"), ("image_cnn", grpc, "gRPC"),
                                  ("image_cnn_flat", http, "HTTP"), ("image_cnn_flat", grpc, "gRPC")]:
        out = run("image_client.py", *face(broker), "-i", protocol, "-m", model, "-c", "3", "-s", "INCEPTION", picture)
        assert "Request 1, batch size 1" in out and out.rstrip().endswith("PASS"), out
        # "    SCORE (INDEX) = LABEL", best first
        rows = [line.split() for line in out.splitlines() if line.startswith("    ")]
        assert len(rows) == 3 and [r[3] for r in rows] == [triton_repo.CLASSES[int(r[1][1:-1])] for r in rows], out
        assert [float(r[0]) for r in rows] == sorted((float(r[0]) for r in rows), reverse=True), out
        answers.append([(r[1], r[3]) for r in rows])
    # one network behind both models (NCHW batched, NHWC without a batch dim): the same top 3
    assert answers[1:] == answers[:1] * 3, answers


def test_ensemble_image_client(broker, tmp_path):
    """ensemble_image_client.py: a JPEG file's bytes through an ensemble (a Python model decoding
    it, then image_cnn), the ensemble's output classified with the ensemble's own labels; the
    answer the same as image_client.py's on the same picture (the same decoding and scaling)."""
    picture = triton_repo.image(str(tmp_path / "picture.jpg"))
    direct = run("image_client.py", *http(broker), "-m", "image_cnn", "-c", "3", "-s", "INCEPTION", picture)
    want = [line.split()[1:] for line in direct.splitlines() if line.startswith("    ")]
    for face, protocol in [(http, "HTTP"), (grpc, "gRPC")]:
        out = run("ensemble_image_client.py", *face(broker), "-i", protocol, "-m", "image_ensemble", "-c", "3", picture)
        assert out.rstrip().endswith("PASS") and "[SCORES]:" in out, out
        assert [line.split()[1:] for line in out.splitlines() if line.startswith("    ")] == want, (out, direct)
