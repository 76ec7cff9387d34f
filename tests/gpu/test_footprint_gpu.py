"""Footprints measured on a GPU (workers/footprint.py, docs/MEMORY.md): the caching allocator's
growth at load and each warm-up size's activation peak, and the fragmentation figure a GPU
worker is judged by. Runs wherever a CUDA device exists (scripts/gpu-check.sh), skipped
cleanly elsewhere."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tgw.broker.fleet.fragmentation import cuda_waste
from tgw.workers.footprint import Gauge, measure_load

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")]
MIB = 1 << 20
WIDE = 1 << 20   # floats of activation per row: 4 MiB a row


class Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4 * MIB // 4))   # 4 MiB of weights

    def forward(self, x):
        return (x[:, :1].repeat(1, WIDE) + self.w[:1]).sum(dim=1, keepdim=True)


class Runner:   # what measure_load needs of a runner: nbytes, warm_up returning its per-size peaks
    def __init__(self, device):
        self.device, self.module = device, Wide().to(device)
        self.nbytes = sum(p.numel() * p.element_size() for p in self.module.parameters())

    def warm_up(self):
        with torch.inference_mode():
            return Gauge(self.device).per_batch([1, 8], lambda rows: self.module(torch.zeros(rows, 4,
                                                                                              device=self.device)))


def test_weights_and_activation_peaks_come_from_the_allocator():
    device = torch.device("cuda", torch.cuda.current_device())
    runner = measure_load(lambda: Runner(device), device)
    fp = runner.footprint
    assert fp.measured_on == "cuda"
    assert 4 * MIB <= fp.weights < 6 * MIB, fp          # the parameter, in the allocator's blocks
    assert fp.by_batch[8] >= 8 * WIDE * 4 > fp.by_batch[1] >= WIDE * 4, fp   # reset per size
    assert fp.activation_peak == fp.by_batch[8]


def test_a_gpu_workers_waste_is_reserved_less_allocated_less_one_batchs_activations():
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.empty_cache()
    keep = [torch.empty(MIB // 4, device=device) for _ in range(64)]   # 64 MiB in 1 MiB tensors
    del keep[::2]                      # every other one freed: segments stay pinned by the rest
    torch.cuda.empty_cache()
    reserved, allocated = torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)
    waste, total = cuda_waste(reserved, allocated, 0)
    assert waste == reserved - allocated and waste >= 16 * MIB and total == reserved
    assert cuda_waste(reserved, allocated, waste)[0] == 0
    del keep
    torch.cuda.empty_cache()
