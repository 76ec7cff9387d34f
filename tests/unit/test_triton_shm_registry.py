"""The registry of Triton's client shared memory (broker/protocol/triton_shm.py) without a broker:
CUDA regions become the descriptors the CUDA IPC path takes, who may register, peer uids."""
from __future__ import annotations

import os
import socket
from types import SimpleNamespace

import pytest

from tgw.broker.front import cuda_route
from tgw.broker.front.cuda_route import REGISTERED, Declared
from tgw.broker.protocol.triton_shm import Caller, TritonShm, check_caller, tcp_peer_uid
from tgw.shm.errors import Code, TgwError
from tgw.shm.wire import PROTOCOL_VERSION, Infer, IOSpec, TensorMeta

HANDLE = bytes(range(64))
GPU = SimpleNamespace(device="cuda:1", device_uuid="GPU-ABCD")


def reason(call) -> str:
    with pytest.raises(TgwError) as info:
        call()
    return info.value.details["reason"]


def registry() -> TritonShm:
    r = TritonShm(1 << 20, [SimpleNamespace(device="cpu", device_uuid=""), GPU])
    r.register_cuda("g", HANDLE, 1, 4096)
    return r


def test_a_cuda_region_becomes_a_cuda_ipc_descriptor_for_its_gpu():
    r = registry()
    assert r.cuda_status(None) == [{"name": "g", "device_id": 1, "byte_size": 4096}]
    meta = TensorMeta(name="x", dtype="float32", shape=[2, 4])
    frame = r.input_frame(meta, {"shared_memory_region": "g", "shared_memory_byte_size": 32,
                                 "shared_memory_offset": 256})
    assert isinstance(frame, Declared) and len(frame) == 32
    d = meta.cuda
    assert (d.device, d.device_uuid, d.handle, d.storage_bytes, d.storage_offset_bytes, d.offset_bytes) == \
        (1, "abcd", HANDLE, 32, 256, 0)
    place = r.output_place("y", {"shared_memory_region": "g", "shared_memory_byte_size": 64,
                                 "shared_memory_offset": 1024})
    assert (place.cuda.storage_bytes, place.cuda.storage_offset_bytes) == (64, 1024)
    written = TensorMeta(name="y", dtype="float32", shape=[2, 4], cuda=place.cuda)
    assert r.write_output(place, written, b"") == {"shared_memory_region": "g", "shared_memory_byte_size": 32,
                                                   "shared_memory_offset": 1024}
    with pytest.raises(TgwError) as info:   # the worker must have written it
        r.write_output(place, TensorMeta(name="y", dtype="float32", shape=[2, 4]), b"")
    assert info.value.code is Code.INTERNAL
    # the door takes it from a face that vouches for the region, not from an unknown transport
    models = {"m": SimpleNamespace(inputs=[IOSpec(name="x", dtype="float32", shape=[4])],
                                   outputs=[IOSpec(name="y", dtype="float32", shape=[4])])}
    msg = Infer(v=PROTOCOL_VERSION, id=1, model="m", inputs=[meta], outputs=["y"], output_cuda={"y": place.cuda})
    binding, sized = cuda_route.inspect([GPU], models, msg, [frame], REGISTERED)
    assert (binding.device, binding.uuid, len(sized[0])) == (1, "abcd", 32)
    assert reason(lambda: cuda_route.inspect([GPU], models, msg, [frame], None)) == "cuda_remote_peer"


def test_cuda_refusals():
    r = registry()
    assert reason(lambda: r.register_cuda("g", HANDLE, 1, 8)) == "shm_exists"
    assert reason(lambda: r.register_cuda("h", HANDLE[:10], 1, 8)) == "shm_cuda_handle"
    assert reason(lambda: r.register_cuda("h", HANDLE, 0, 8)) == "no_worker_on_device"
    assert reason(lambda: r.register_cuda("h", HANDLE, 1, 0)) == "shm_byte_size"
    meta = TensorMeta(name="x", dtype="float32", shape=[2])
    assert reason(lambda: r.input_frame(meta, {"shared_memory_region": "g", "shared_memory_byte_size": 8,
                                               "shared_memory_offset": 2})) == "shm_alignment"
    assert reason(lambda: r.input_frame(meta, {"shared_memory_region": "g", "shared_memory_byte_size": 8,
                                               "shared_memory_offset": 4092})) == "shm_bounds"
    assert reason(lambda: r.input_frame(meta, {"shared_memory_region": "g"})) == "shm_byte_size"
    assert r.input_frame(meta, {}) is None and r.output_place("y", {"binary_data": True}) is None
    r.roster.remove(GPU)   # the GPU's worker is gone: its regions cannot be served now
    assert reason(lambda: r.input_frame(meta, {"shared_memory_region": "g", "shared_memory_byte_size": 8})) \
        == "no_worker_on_device"
    r.unregister_cuda("nope")
    r.unregister_cuda("")
    assert r.cuda_status(None) == [] and r.as_dict()["unregistrations"] == 1


def test_only_the_brokers_uid_registers_and_an_unknown_one_needs_the_token():
    check_caller(Caller(os.geteuid()))
    check_caller(Caller(None, token=True))
    assert reason(lambda: check_caller(Caller(os.geteuid() + 1))) == "shm_uid"
    assert reason(lambda: check_caller(Caller(None))) == "shm_caller_unknown"
    with pytest.raises(TgwError) as info:
        TritonShm(1024).register_system("r", "/nothing_here", 0, 8, Caller(os.geteuid() + 1))
    assert info.value.code is Code.UNAUTHENTICATED


@pytest.mark.parametrize("family,host", [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")])
def test_a_loopback_peers_uid_is_found_by_its_address_pair(family, host):
    try:
        server = socket.socket(family)
        server.bind((host, 0))
    except OSError:
        pytest.skip(f"no {host} here")
    with server:
        server.listen()
        with socket.create_connection(server.getsockname()[:2]) as client:
            accepted, peer = server.accept()
            with accepted:
                assert tcp_peer_uid(peer[:2], accepted.getsockname()[:2]) == os.geteuid()
                assert tcp_peer_uid(client.getsockname()[:2], ("127.0.0.2", 1)) is None
