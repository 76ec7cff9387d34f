"""A real sticky CUDA error: an out-of-range index on the GPU (a device-side assert) amid traffic.
The worker is replaced (a new CUDA context), nothing is answered wrongly, every other request is
served, the index is blamed after at most two faults; the recovery time is printed in the fault
table. Runs wherever a CUDA device exists (scripts/gpu-check.sh), skipped cleanly elsewhere."""
from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from conftest import Load, base_config, wait_until
from tgw.client import Client
from tgw.shm.errors import Code, TgwError

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "faults"))
from tally import Tally, row  # noqa: E402 - the fault table's helper lives with the fault tests

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")]
TABLE = 1000
IO = {"inputs": [{"name": "x", "dtype": "int64", "shape": [1]}],
      "outputs": [{"name": "y", "dtype": "float32", "shape": [1]}]}


class Lookup(nn.Module):
    """x int64 [batch, 1] -> table[x]: an index past the table is a device-side assert on CUDA."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.arange(TABLE, dtype=torch.float32) * 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.table[x.squeeze(1)].unsqueeze(1)


def test_device_side_assert_replaces_the_worker_and_blames_the_index(make_broker, tmp_path):
    path = str(tmp_path / "lookup.pt")
    torch.jit.script(Lookup()).save(path)
    files = {"lookup": (path, IO)}
    b = make_broker(base_config(files, "lookup", workers={"devices": ["cuda:0"]}, lookup={"max_batch_size": 8}))
    wrong: list = []

    def check(inputs, outcome) -> None:
        if isinstance(outcome, dict) and not np.array_equal(outcome["y"], inputs["x"].astype(np.float32) * 2):
            wrong.append(inputs["x"])

    mates, poison = Tally("device-side assert (GPU): the other requests, 16 callers"), Tally("device-side assert: the index")
    load = Load(b.address, 16, lambda i, k: {"x": np.full((1, 1), (i * 37 + k) % TABLE, np.int64)},
                model="lookup", tally=mates, on_result=check)
    with Client(b.address) as c:
        wait_until(lambda: len(load.results) > 200, 120, "traffic to flow")
        t0 = time.monotonic()
        err = poison.call(c.infer, "lookup", {"x": np.full((1, 1), 10**6, np.int64)}, timeout=120)
        blamed_s = time.monotonic() - t0
        status = wait_until(lambda: (s := c.status()) and s["devices"]["cuda:0"]["state"] == "serving" and s, 120,
                            "the replaced worker to serve")
        recovered_s = time.monotonic() - t0
        served = len(load.results)
        wait_until(lambda: len(load.results) > served + 100, 120, "traffic after the recovery")
    load.finish()
    faults = status["cuda_faults"]
    row(mates, f"{len(wrong)} wrong answers")
    row(poison, f"blamed after {faults['total']} fault(s) in {blamed_s:.2f} s; cuda:0 serving again "
                f"{recovered_s:.2f} s after the request was sent")
    assert isinstance(err, TgwError) and err.code is Code.WORKER_DIED and err.details["poison"] is True
    assert mates.counts == {"ok": mates.sent} and wrong == []
    assert 1 <= faults["total"] <= 2
    last = faults["recent"][-1]
    assert last["kind"] == "device-side assert triggered" and last["uuid"].startswith(("GPU-", "MIG-"))
    assert "model=lookup" in last["blamed"]
