"""The CUDA fault policy without processes: which errors are sticky, the fault record and the
per-device out-of-service rule (with its probe), the supervisor holding a device's restart, and
each device's state as status, health and /metrics show it. Times are passed in."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fake_clock import Clock
from tgw.broker.config.load import CudaFaultDecl, SupervisorDecl, WorkersDecl
from tgw.broker.fleet.faults import CudaFaults
from tgw.broker.fleet.supervisor import Supervisor
from tgw.broker.observe.devices import device_states, missing
from tgw.broker.state.pool import Inflight, WorkerHandle, WorkerState
from tgw.broker.sched.batcher import Pending
from tgw.shm.segment import Segment, new_name
from tgw.shm.wire import Batch, WorkerFault
from tgw.workers.answers import failed
from tgw.workers.cuda_faults import CudaFault, error_line, fault_of, sticky_kind

TORCH_TEXTS = {   # as torch words them (c10/cuda/CUDAException.cpp: "CUDA error: " + cudaGetErrorString)
    "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be asynchronously reported":
        "an illegal memory access was encountered",
    "CUDA error: device-side assert triggered\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.":
        "device-side assert triggered",
    "CUDA error: unspecified launch failure": "unspecified launch failure",
    "CUDA error: uncorrectable ECC error encountered": "uncorrectable ECC error",
    "CUDA error: misaligned address": "misaligned address",
}


@pytest.mark.parametrize("text,kind", list(TORCH_TEXTS.items()))
def test_sticky_cuda_errors_are_known_by_torchs_message(text, kind):
    assert sticky_kind(RuntimeError(text)) == kind
    assert sticky_kind(torch.jit.Error(f"The following operation failed in the TorchScript interpreter.\n{text}")) == kind
    assert error_line(RuntimeError(f"Traceback ...\n{text}")) == text.splitlines()[0]


@pytest.mark.parametrize("exc", [RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"),
                                 RuntimeError("index 7 is out of bounds"), RuntimeError("CUDA error: invalid argument"),
                                 RuntimeError("an illegal memory access was encountered")])   # no CUDA in it
def test_other_errors_are_not_sticky(exc):
    assert sticky_kind(exc) == "" and fault_of(exc, 1) is None


def test_a_sticky_error_is_no_batch_answer():
    batch = Batch(batch_id=4, model="m", version="1", rows=1, block=0, inputs=[])
    with pytest.raises(CudaFault) as caught:
        failed(batch, RuntimeError("CUDA error: device-side assert triggered"))
    assert caught.value.batch_id == 4 and caught.value.kind == "device-side assert triggered"
    assert failed(batch, RuntimeError("a model bug")).error.code == "MODEL_EXECUTION_ERROR"


@pytest.fixture
def workers():
    made = []

    def make(worker_id: int = 0, device: str = "cuda:0") -> WorkerHandle:
        w = WorkerHandle(worker_id, device, [], Segment.create(new_name("ring"), 8192), 4096, 4096)
        w.spawned(None)
        w.became_ready(["m:1"])
        w.device_uuid = f"GPU-{device[-1]}"
        made.append(w)
        return w
    yield make
    for w in made:
        w.segment.close()
        w.segment.unlink()


def pending(req_id: int, alone: bool = False) -> Pending:
    return Pending(client=b"\x01c", req_id=req_id, model="m", version="1", rows=1, shape_key=(),
                   tensors=[b"x" * 4], outputs=["y"], deadline=1e9, alone=alone)


def fault(batch_id=7) -> WorkerFault:
    return WorkerFault(worker_id=0, batch_id=batch_id, error="CUDA error: an illegal memory access was encountered",
                       kind="an illegal memory access was encountered")


def test_a_fault_poisons_the_worker_and_records_its_batch(workers):
    clock, written = Clock(), []
    faults = CudaFaults(CudaFaultDecl(), clock, write=lambda w, r: written.append(r) or "/snap.json")
    w = workers()
    w.inflight[7] = Inflight(7, "m", "m:1", [pending(1), pending(2)], 0, 2)
    record = faults.on_fault(w, fault())
    assert w.state is WorkerState.STOPPING and w.faulted.startswith("sticky CUDA error")
    assert faults.to_kill == [w] and written == [record] and record["snapshot"] == "/snap.json"
    assert record["blamed"] is None and len(record["suspects"]) == 2 and record["uuid"] == "GPU-0"
    w2 = workers(1)
    w2.inflight[9] = Inflight(9, "m", "m:1", [pending(1, alone=True)], 0, 1)   # a retry, alone: it is to blame
    assert "id=1" in faults.on_fault(w2, fault(9))["blamed"]
    assert faults.as_dict()["by_device"] == {"cuda:0": 2} and faults.as_dict()["total"] == 2


def test_repeated_faults_take_a_device_out_then_a_probe(workers):
    clock = Clock()
    faults = CudaFaults(CudaFaultDecl(faults=2, window_s=60.0, out_of_service_s=100.0), clock)
    faults.on_fault(workers(0), fault())
    clock.t += 61                                   # the first fell out of the window: no rule yet
    faults.on_fault(workers(1), fault())
    assert faults.held_until("cuda:0") is None
    clock.t += 1
    faults.on_fault(workers(2), fault())            # two within 60 s
    assert faults.held_until("cuda:0") == clock.t + 100 and "cuda:0" in faults.out_of_service()
    assert faults.held_until("cuda:1") is None
    clock.t += 100
    assert faults.held_until("cuda:0") is None and faults.out_of_service() == {}   # back, as a probe
    clock.t += 30
    faults.on_fault(workers(3), fault())            # one fault on the probe takes it out again
    assert faults.held_until("cuda:0") == clock.t + 100


def test_supervisor_starts_no_worker_on_a_device_out_of_service(tmp_path):
    clock, until = Clock(), {"cuda:0": None}
    sup = Supervisor(WorkersDecl(devices=["cpu"], input_arena_mb=1, output_arena_mb=1),
                     SupervisorDecl(snapshot_dir=str(tmp_path)), "ipc:///nowhere", clock=clock)
    sup.hold = lambda device: until["cuda:0"]
    seg = Segment.create(new_name("ring"), 4096)
    w = WorkerHandle(0, "cuda:0", [], seg, 2048, 2048)
    sup.workers.append(w)
    spawned = []
    sup.spawn = lambda w: spawned.append(w) or w.spawned(None)
    try:
        w.spawned(None)
        w.exited()
        until["cuda:0"] = clock.t + 50
        sup.schedule_restart(w)
        clock.t += 10
        assert sup.due_restarts() == [] and "out of service" in w.benched and sup.restart_at(w) == until["cuda:0"]
        clock.t += 40
        until["cuda:0"] = None
        assert sup.due_restarts() == [w] and spawned == [w]
    finally:
        w.segment.close()
        w.segment.unlink()


def test_each_devices_state_and_the_missing_capacity(workers):
    a, b = workers(0, "cuda:0"), workers(1, "cuda:1")
    b.met_fault("sticky CUDA error (misaligned address): CUDA error: misaligned address")
    model = SimpleNamespace(name="m", removed=False, decl=SimpleNamespace(is_stage=False, device=None))
    faults = {"by_device": {"cuda:1": 1}, "out_of_service": {}}
    view = SimpleNamespace(roster=[a, b], models={"m": model}, faults=lambda: faults)
    states = device_states(view)
    assert states["cuda:0"]["state"] == "serving" and states["cuda:0"]["models_lost"] == []
    assert states["cuda:1"]["state"] == "faulted" and states["cuda:1"]["faults"] == 1
    assert states["cuda:1"]["models_lost"] == ["m"] and states["cuda:1"]["uuid"] == "GPU-1"
    b.exited()
    faults["out_of_service"] = {"cuda:1": {"reason": "3 sticky CUDA error(s)", "left_s": 12.0}}
    states = device_states(view)
    assert states["cuda:1"]["state"] == "out_of_service"
    assert missing(states) == ["cuda:1 is out_of_service (3 sticky CUDA error(s); next start in 12 s): m served "
                               "without it"]
