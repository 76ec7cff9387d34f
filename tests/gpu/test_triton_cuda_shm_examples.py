"""Triton's CUDA shared-memory client examples (tests/data/triton-client-examples/, unchanged)
against the stand-in repository's `simple` on a CUDA worker, over HTTP and gRPC: each exits 0
with its PASS line. Skipped without CUDA (or cuda-python, which tritonclient's CUDA module needs)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tgw.client import Client
from tgw.testing import triton_repo

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")]
EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "data", "triton-client-examples")


def test_the_cuda_shm_examples_pass_unchanged(make_broker, short_dir):
    pytest.importorskip("tritonclient.utils.cuda_shared_memory")
    repo = os.path.join(short_dir, "repo")
    triton_repo.write(repo, only=("simple",))
    cfg = {"http": {"port": 0, "allow_client_shm": True}, "grpc": {"port": 0, "allow_client_shm": True},
           "workers": {"devices": ["cuda:0"], "threads_per_worker": 1}}
    b = make_broker(cfg, start=False).start(args=("--model-repository", repo), timeout=120)
    with Client(b.address) as c:
        st = c.status()
    for example, url, passed in [("simple_http_cudashm_client.py", st["http"].removeprefix("http://"),
                                  "PASS: cuda shared memory"),
                                 ("simple_grpc_cudashm_client.py", st["grpc"], "PASS: cudashm")]:
        proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, example), "-u", url], capture_output=True,
                              text=True, timeout=120)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0 and passed in out, f"{example} exited {proc.returncode}:\n{out[-3000:]}"
