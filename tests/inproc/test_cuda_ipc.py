"""CUDA tensors by IPC handle (docs/PROTOCOL.md 5.10): the wire, the broker's routing and
refusals, the worker's batch path (with storages stood in by CPU ones) and the client's checks
run everywhere; a real handle's checks only where a CUDA device exists (marked gpu). Through a
real broker: tests/process/test_cuda_ipc_broker.py, and end to end on a GPU:
tests/gpu/test_cuda_ipc_gpu.py."""
from __future__ import annotations

import os
import types

import numpy as np
import pytest
import torch
import zmq

from models import MODELS, save
from tgw.broker.front import cuda_route, peers
from tgw.broker.state import pending as gpu_binding
from tgw.broker.sched.batcher import Batcher
from tgw.broker.state.pending import Pending
from tgw.client import cuda as client_cuda
from tgw.shm.errors import Code, TgwError
from tgw.shm.segment import Segment, new_name
from tgw.shm.wire import (PROTOCOL_VERSION, Batch, BlockTensor, CudaIpc, Infer, IOSpec, ModelSpec, TensorMeta,
                          WorkerHello, encode, from_worker_decoder, request_decoder,
                          to_worker_decoder)
from tgw.workers import cuda_ipc
from tgw.workers.runner import ModelRunner
from tgw.workers.serve import Server

HAS_CUDA = torch.cuda.is_available()


def ipc(device: int = 0, uuid: str = "u-0", nbytes: int = 4096, offset: int = 0) -> CudaIpc:
    return CudaIpc(device=device, device_uuid=uuid, handle=b"\x01" * 64, storage_bytes=nbytes,
                   storage_offset_bytes=0, offset_bytes=offset, ref_counter_handle=b"/torch_1_2_3",
                   ref_counter_offset=7, event_handle=b"\x02" * 64, event_sync_required=True)


# ---- wire ------------------------------------------------------------------------------------

def test_wire_round_trip_of_cuda_descriptors():
    msg = Infer(v=PROTOCOL_VERSION, id=3, model="m",
                inputs=[TensorMeta(name="x", dtype="float32", shape=[2, 4], cuda=ipc())],
                output_cuda={"y": ipc(offset=64)})
    assert request_decoder.decode(encode(msg)) == msg
    batch = Batch(batch_id=1, model="m", version="1", rows=2, block=0, inputs=[], splits=[2],
                  cuda_inputs=[[ipc()]], cuda_outputs=[{"y": ipc()}])
    assert to_worker_decoder.decode(encode(batch)) == batch
    hello = WorkerHello(v=PROTOCOL_VERSION, worker_id=0, pid=1, device_uuid="GPU-abc")
    assert from_worker_decoder.decode(encode(hello)) == hello
    plain = Batch(batch_id=1, model="m", version="1", rows=1, block=0, inputs=[])
    assert b"cuda" not in encode(plain)   # defaults stay off the wire


# ---- broker: cuda_route ------------------------------------------------------------------------

class Header:
    def __init__(self, addr):
        self.addr = addr

    def get(self, key):
        assert key == "Peer-Address"
        if self.addr is None:
            raise zmq.ZMQError(zmq.EINVAL)
        return self.addr


@pytest.mark.parametrize("addr,local", [("localhost:1000:1000:4242", True), (":0:0:7", True), (None, True),
                                        ("127.0.0.1", False), ("::1", False), ("fe80::1:2:3", False)])
def test_peer_is_local(addr, local):
    assert peers.is_local(Header(addr)) is local
    assert peers.is_local(None) is False   # the HTTP face


def fake_broker(*devices: str, uuids=()):
    roster = [types.SimpleNamespace(device=d, device_uuid=u) for d, u in zip(devices, [*uuids, *[""] * 9])]
    models = {"m": types.SimpleNamespace(inputs=[IOSpec(name="x", dtype="float32", shape=[4]),
                                                 IOSpec(name="z", dtype="float32", shape=[4])],
                                         outputs=[IOSpec(name="y", dtype="float32", shape=[4])])}
    return types.SimpleNamespace(roster=roster, registry=types.SimpleNamespace(models=models))


def infer(*metas, **kw) -> Infer:
    return Infer(v=PROTOCOL_VERSION, id=1, model="m", inputs=list(metas), **kw)


def meta(name, cuda=None, rows=2):
    return TensorMeta(name=name, dtype="float32", shape=[rows, 4], cuda=cuda)


LOCAL = Header("localhost:0:0:1")


def refused(b, msg, frames, header=LOCAL) -> TgwError:
    with pytest.raises(TgwError) as info:
        cuda_route.inspect(b.roster, b.registry.models, msg, frames, header)
    assert info.value.code is Code.INVALID_ARGUMENT
    return info.value


def test_no_cuda_passes_untouched():
    frames = [b"x" * 32]
    assert cuda_route.inspect([], {}, infer(meta("x")), frames, None) == (None, frames)


def test_refusals():
    both = [meta("x", ipc()), meta("z", ipc())]
    err = refused(fake_broker("cpu"), infer(*both), [b"", b""])
    assert err.details["reason"] == "no_worker_on_device" and "cuda:0" in err.message
    assert err.details["device"] == "cuda:0"
    assert refused(fake_broker("cuda:0"), infer(*both), [b"", b""], Header("10.0.0.1")).details["reason"] == \
        "cuda_remote_peer"
    assert refused(fake_broker("cuda:0"), infer(*both), [b"", b""], None).details["reason"] == "cuda_remote_peer"
    assert refused(fake_broker("cuda:0"), infer(meta("x", ipc()), meta("z")), [b"", b"z" * 32]).details["reason"] \
        == "cuda_mixed"
    assert refused(fake_broker("cuda:0", "cuda:1"), infer(meta("x", ipc()), meta("z", ipc(1, "u-1"))),
                   [b"", b""]).details["reason"] == "cuda_devices_differ"
    assert refused(fake_broker("cuda:0"), infer(meta("x", ipc(nbytes=16)), meta("z", ipc())),
                   [b"", b""]).details["reason"] == "cuda_bad_handle"
    assert refused(fake_broker("cuda:0"), infer(meta("x"), meta("z"), output_cuda={"nope": ipc()}),
                   [b"x" * 32, b"z" * 32]).details["reason"] == "cuda_output_unknown"
    # output buffers alone bind a request to their GPU too
    assert refused(fake_broker("cpu"), infer(meta("x"), meta("z"), output_cuda={"y": ipc()}),
                   [b"x" * 32, b"z" * 32]).details["reason"] == "no_worker_on_device"


def test_matching_by_uuid_beats_the_index():
    b = fake_broker("cuda:0", "cuda:1", uuids=["GPU-aaa", "GPU-bbb"])
    cuda, _ = cuda_route.inspect(b.roster, b.registry.models, infer(meta("x", ipc(0, "bbb")), meta("z", ipc(0, "bbb"))), [b"", b""], LOCAL)
    p = types.SimpleNamespace(cuda=cuda)
    assert [gpu_binding.gpu_fits(w, p) for w in b.roster] == [False, True]   # the client's index 0 is our 1
    assert gpu_binding.gpu_fits(b.roster[0], types.SimpleNamespace(cuda=None))


def pending(b, cuda=None, frames=None, shape_key=()):
    p = Pending(client=b"c", req_id=1, model="m", version="1", rows=2, shape_key=shape_key,
                tensors=[f.buffer if hasattr(f, "buffer") else f for f in frames], outputs=["y"], deadline=1e9)
    cuda_route.bind(b.registry.models, p, cuda)
    return p


def test_bind_orders_descriptors_and_tags_the_shape_key():
    b = fake_broker("cuda:0")
    zx, dx = ipc(offset=0), ipc(offset=32)
    msg = infer(meta("z", zx), meta("x", dx), output_cuda={"y": ipc()})
    cuda, frames = cuda_route.inspect(b.roster, b.registry.models, msg, [b"", b""], LOCAL)
    assert [len(f) for f in frames] == [32, 32] and all(len(f.buffer) == 0 for f in frames)
    p = pending(b, cuda, frames)
    assert p.cuda.inputs == [dx, zx]                  # declared order: x, z
    assert p.nbytes == [0, 0] and p.in_total == 0     # no ring bytes
    assert p.shape_key == (("cuda", 0, "u-0", "in"),) and gpu_binding.plain_dims(p.shape_key) == ()
    assert gpu_binding.plain_dims(((5,), ("cuda", 0, "u", "in"))) == ((5,),)


def test_batches_never_mix_gpus_or_kinds():
    b = fake_broker("cuda:0", "cuda:1")
    batcher = Batcher(clock=lambda: 0.0)
    batcher.add_model("m", max_batch_size=16, max_queue=16)
    plain = [pending(b, frames=[b"x" * 32, b"z" * 32]) for _ in range(2)]
    on0 = [pending(b, *(cuda_route.inspect(b.roster, b.registry.models, infer(meta("x", ipc()), meta("z", ipc())), [b"", b""],
                                                   LOCAL))) for _ in range(2)]
    on1 = pending(b, *(cuda_route.inspect(b.roster, b.registry.models, infer(meta("x", ipc(1, "u-1")), meta("z", ipc(1, "u-1"))),
                                                  [b"", b""], LOCAL)))
    for p in (plain[0], on0[0], on1, plain[1], on0[1]):
        batcher.push(p)
    got = [batcher.next_batch("m", 1 << 20) for _ in range(3)]
    assert got == [plain, on0, [on1]]


def test_stage_puts_descriptors_in_the_batch(tmp_path):
    from tgw.broker.state.pool import WorkerHandle
    seg = Segment.create(new_name("ring"), 8192)
    try:
        w = WorkerHandle(0, "cuda:0", [], seg, 4096, 4096)
        b = fake_broker("cuda:0")
        ps = [pending(b, *(cuda_route.inspect(b.roster, b.registry.models, infer(meta("x", ipc(offset=k * 64)), meta("z", ipc())),
                                                      [b"", b""], LOCAL))) for k in range(2)]
        batch = w.stage(1, ps, b.registry.models["m"].inputs)
        assert batch.cuda_inputs == [p.cuda.inputs for p in ps] and batch.cuda_outputs == []
        assert [t.shape for t in batch.inputs] == [[4, 4], [4, 4]] and all(t.nbytes == 0 for t in batch.inputs)
        assert to_worker_decoder.decode(encode(batch)) == batch
        assert w.can_take("m:1", 2, head=ps[0]) is False     # not ready; the device check alone:
        assert gpu_binding.gpu_fits(w, ps[0]) and not gpu_binding.gpu_fits(types.SimpleNamespace(device="cpu"), ps[0])
    finally:
        seg.close()
        seg.unlink()


# ---- worker: the batch path, storages stood in by CPU ones --------------------------------------

class Sock:
    def __init__(self):
        self.sent = []

    def send(self, data):
        self.sent.append(from_worker_decoder.decode(data))

    def poll(self, timeout=0):
        return 0   # nothing more from the broker: these tests hand the server its batches directly


@pytest.fixture
def server(tmp_path):
    path = str(tmp_path / "double.pt")
    save("double", path)
    io = {k: [IOSpec(**t) for t in MODELS["double"][1][k]] for k in ("inputs", "outputs")}
    runner = ModelRunner(ModelSpec(name="double", version="1", path=path, **io), torch.device("cpu"))
    seg = Segment.create(new_name("ring"), 2 * 65536)
    yield Server(Sock(), seg, 65536, 65536, {runner.key: runner})
    try:
        seg.close()
    except BufferError:   # a test's array still views the mapping; it goes with the process
        pass
    seg.unlink()


def cuda_batch(descs, rows, width=3, outputs=None):
    return Batch(batch_id=5, model="double", version="1", rows=sum(rows), block=0,
                 inputs=[BlockTensor(name="x", dtype="float32", shape=[sum(rows), width], offset=0, nbytes=0)],
                 splits=list(rows), cuda_inputs=[[d] for d in descs], cuda_outputs=outputs or [])


def test_a_cpu_worker_answers_a_cuda_batch_with_a_clear_error_and_keeps_serving(server):
    done = server.run_batch(cuda_batch([ipc(nbytes=24)], [2]))
    assert done.error.code == Code.INVALID_ARGUMENT.value and done.error.details["reason"] == "cuda_wrong_device"
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    server.segment.buf[:24] = x.tobytes()
    plain = Batch(batch_id=6, model="double", version="1", rows=2, block=0,
                  inputs=[BlockTensor(name="x", dtype="float32", shape=[2, 3], offset=0, nbytes=24)], splits=[2])
    done = server.run_batch(plain)
    assert done.error is None
    y = np.frombuffer(server.segment.buf, np.float32, 6, done.outputs[0].offset).reshape(2, 3)
    np.testing.assert_array_equal(y, 2 * x)


@pytest.fixture
def cpu_storages(monkeypatch):
    """open_storage maps descriptor handles to CPU storages of this process (the path after
    opening - layout checks, cat, forward, writes, parts - is the one a GPU worker runs)."""
    table: dict[bytes, torch.UntypedStorage] = {}

    def fake_open(d, device, own=""):
        if d.handle not in table:
            raise cuda_ipc._bad("cannot open the CUDA IPC handle: test")
        return table[d.handle]
    monkeypatch.setattr(cuda_ipc, "open_storage", fake_open)

    def share(t: torch.Tensor, exact=False) -> CudaIpc:
        handle = os.urandom(16)
        table[handle] = t.untyped_storage()
        off = t.storage_offset() * t.element_size()
        return CudaIpc(device=0, device_uuid="", handle=handle, storage_bytes=t.untyped_storage().nbytes(),
                       storage_offset_bytes=0, offset_bytes=off)
    return share


def test_cuda_path_inputs_in_place_outputs_into_buffers_and_a_bad_request_alone(server, cpu_storages):
    base = torch.arange(40, dtype=torch.float32)
    a = base[4:10].view(2, 3)                 # a view at an offset into a larger storage
    c = torch.full((1, 3), 7.0)
    out_a, out_c = torch.zeros(2, 3), torch.zeros(1, 3)
    bad = ipc(nbytes=12)                      # a handle nobody can open
    batch = cuda_batch([cpu_storages(a), bad, cpu_storages(c)], [2, 1, 1],
                       outputs=[{"y": cpu_storages(out_a)}, {}, {"y": cpu_storages(out_c)}])
    done = server.run_batch(batch)
    parts = [*server.sock.sent, done]
    assert [(p.first, p.count, p.final, p.error is None) for p in parts] == \
        [(0, 1, False, True), (1, 1, False, False), (2, 1, True, True)]
    assert parts[1].error.details["reason"] == "cuda_bad_handle"
    torch.testing.assert_close(out_a, 2 * a)
    torch.testing.assert_close(out_c, 2 * c)
    assert all(t.nbytes == 0 and t.shape[1:] == [3] for p in (parts[0], parts[2]) for t in p.outputs)


def test_cuda_path_whole_batch_with_host_outputs(server, cpu_storages):
    a, c = torch.ones(2, 3), torch.full((1, 3), 3.0)
    done = server.run_batch(cuda_batch([cpu_storages(a), cpu_storages(c)], [2, 1]))
    assert done.error is None and done.final and done.first == 0
    t = done.outputs[0]
    y = np.frombuffer(server.segment.buf, np.float32, 9, t.offset).reshape(3, 3)
    np.testing.assert_array_equal(y, [[2] * 3, [2] * 3, [6] * 3])


def test_cuda_path_refuses_a_too_small_output_buffer(server, cpu_storages):
    a = torch.ones(2, 3)
    small = torch.zeros(1, 3)
    done = server.run_batch(cuda_batch([cpu_storages(a)], [2], outputs=[{"y": cpu_storages(small)}]))
    assert done.error.details["reason"] == "cuda_buffer_too_small"
    assert torch.count_nonzero(small) == 0


def test_over_builds_views_and_checks_bounds():
    s = torch.arange(10, dtype=torch.float32).untyped_storage()
    t = cuda_ipc.over(s, torch.float32, [2, 2], 8, "x")
    assert t.tolist() == [[2, 3], [4, 5]] and t.is_contiguous()
    with pytest.raises(TgwError, match="needs 24 bytes"):
        cuda_ipc.over(s, torch.float32, [2, 3], 24, "x")
    with pytest.raises(TgwError, match="not a multiple"):
        cuda_ipc.over(s, torch.float32, [1], 2, "x")


# ---- client ------------------------------------------------------------------------------------

def test_client_split_and_describe_refusals():
    x = np.zeros((2, 3), np.float32)
    t = torch.zeros(2, 3)
    assert client_cuda.split({"x": x, "t": t}) == ({"x": x, "t": t}, {})
    assert not client_cuda.is_cuda(t) and not client_cuda.is_cuda(x)
    with pytest.raises(TgwError, match="takes a CUDA tensor"):
        client_cuda.describe(t)
    with pytest.raises(TgwError, match="takes a CUDA tensor"):
        client_cuda.describe(x)


def test_client_module_imports_no_torch():
    import subprocess
    import sys
    code = "import sys, tgw.client.cuda; print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "False", r.stderr


def test_plan_reads_cuda_outputs_as_the_callers_tensors():
    buf = torch.zeros(2, 3)
    plan = client_cuda.CudaPlan()
    plan.outputs["y"] = buf
    metas = [TensorMeta(name="y", dtype="float32", shape=[2, 3], cuda=ipc()),
             TensorMeta(name="z", dtype="float32", shape=[1])]
    host_metas, frames, on_gpu = plan.read(metas, [b"", b"abcd"])
    assert on_gpu["y"] is buf and [m.name for m in host_metas] == ["z"] and frames == [b"abcd"]
    assert plan.released
    wider = torch.zeros(8)
    plan.outputs["y"] = wider
    _, _, on_gpu = client_cuda.CudaPlan.read(plan, metas[:1], [b""])
    assert on_gpu["y"].shape == (2, 3) and on_gpu["y"].data_ptr() == wider.data_ptr()


# ---- GPU: real handles, end to end --------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device on this machine")
def test_describe_refuses_non_contiguous_cuda_tensors():
    t = torch.zeros(4, 4, device="cuda:0").t()
    with pytest.raises(TgwError, match="C-contiguous"):
        client_cuda.describe(t)
    d = client_cuda.describe(torch.zeros(4, 4, device="cuda:0")[1:])
    assert d.offset_bytes == 16 and d.storage_bytes >= 64 and d.handle
    assert d.device == 0 and d.device_uuid == str(torch.cuda.get_device_properties(0).uuid)
