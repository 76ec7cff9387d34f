"""The serving loop meeting a sticky CUDA error (workers/cuda_faults.py), in-process on the rig of
test_worker_loop.py: the batch is not answered, the broker is told (WorkerFault, naming the
batch) and serve() ends with CudaFault; an ordinary model error is still the batch's answer."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import worker_ext
from test_worker_loop import WAIT_S, Worker
from tgw.shm.wire import Done, IOSpec, ModelSpec, WorkerFault, from_worker_decoder
from tgw.workers.cuda_faults import CudaFault
from tgw.workers.runner import ModelRunner


@pytest.fixture(scope="module")
def fault_runner(tmp_path_factory) -> dict[str, ModelRunner]:
    path = str(tmp_path_factory.mktemp("fault") / "fault_on.pt")
    worker_ext.save("fault_on", path)
    io = {k: [IOSpec(**t) for t in worker_ext.IO[k]] for k in ("inputs", "outputs")}
    runner = ModelRunner(ModelSpec(name="fault_on", version="1", path=path, **io), torch.device("cpu"))
    return {runner.key: runner}


def test_a_sticky_error_is_reported_not_answered(fault_runner):
    w = Worker(fault_runner, 64 << 10, worker_id=5)
    try:
        w.batch(np.ones((2, 1), np.float32), model="fault_on")
        assert w.outputs(w.recv())[0].tolist() == [[2.0], [2.0]]
        poison = w.batch(np.array([[1.0], [worker_ext.POISON]], np.float32), model="fault_on")
        assert w.router.poll(int(WAIT_S * 1000)), "no word from the worker after the fault"
        msg = from_worker_decoder.decode(w.router.recv_multipart()[1])
        w.thread.join(WAIT_S)
        assert not w.thread.is_alive(), "serve() went on after a sticky CUDA error"
        assert isinstance(msg, WorkerFault) and not isinstance(msg, Done)
        assert msg.worker_id == 5 and msg.batch_id == poison.batch_id
        assert msg.kind == "an illegal memory access was encountered" and msg.error.startswith("CUDA error:")
        assert isinstance(w.error, CudaFault) and w.error.batch_id == poison.batch_id
        assert not w.router.poll(0), "the faulted batch was answered too"
    finally:
        w.close()
