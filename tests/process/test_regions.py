"""Client shared-memory regions (docs/PROTOCOL.md 5.9) through a real broker: region inputs and
outputs give what the socket gives; registration is refused for another uid, for unsealed or
non-memfd descriptors, and swept when its process dies; bad references are refused clearly."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading

import numpy as np
import pytest

from conftest import base_config, wait_until
from tgw.testing.child import BrokerProc
from tgw.testing.regions import Caller
from tgw.broker.front.regions import peer_of
from tgw.client import Client, TgwError
from tgw.client.regions import Region, Slots, output_bytes_for
from tgw.client.request import prepare
from tgw.shm.wire import PROTOCOL_VERSION, RegionSlice, RegisterRegion, Stats, UnregisterRegion

IMAGE = (1, 3, 224, 224)      # 602,112 bytes of float32
LOGITS = output_bytes_for([1000 * 4])

# a process of its own that registers a region, says its handle, and waits (killed by the test)
HOLDER = """
import json, sys
from tgw.testing.regions import Caller
from tgw.client.regions import Region
caller = Caller(sys.argv[1])
try:
    r = caller.region(1 << 20)
    print(json.dumps({"region": r.handle}), flush=True)
except Exception as exc:
    print(json.dumps({"code": exc.code.value, "reason": exc.details.get("reason"), "message": exc.message}),
          flush=True)
    sys.exit(0)
sys.stdin.read()
"""


@pytest.fixture(scope="module")
def broker(model_files):
    d = tempfile.mkdtemp(prefix="tgwg-", dir="/tmp")
    path, io = model_files["resnet"]
    cfg = base_config(model_files, "mlp", server={"max_request_bytes": 8 << 20, "max_region_bytes": 64 << 20})
    cfg["models"].append({"name": "resnet224", "versions": [{"version": "1", "path": path}],
                          "inputs": [{**io["inputs"][0], "shape": [3, 224, 224]}], "outputs": io["outputs"],
                          "max_batch_size": 4})
    b = BrokerProc(cfg, d).start()
    yield b
    assert b.stop() == 0, b.output()
    import shutil
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def caller(broker):
    c = Caller(broker.address)
    yield c
    c.close()


def regions(c: Caller) -> dict:
    return dict(c.send(Stats(v=PROTOCOL_VERSION)).regions)


def refused(fn) -> TgwError:
    with pytest.raises(TgwError) as info:
        fn()
    return info.value


def test_region_inputs_equal_the_socket_path(caller):
    x = np.random.default_rng(0).standard_normal(IMAGE, dtype=np.float32)
    before = regions(caller)
    with caller.region(4 << 20) as region:
        via_socket = caller.infer("resnet224", {"image": x})["logits"]
        call = prepare(1, "resnet224", {"image": x}, token=None, default_tenant=None, address="ipc://test", region=region)
        assert call.frames == [b""] and call.msg.inputs[0].region == region.handle and call.sent == 0
        region.release(call.slots)
        via_region = caller.infer("resnet224", {"image": x}, region=region)["logits"]
        assert region.free_bytes() == region.nbytes            # the call's slot is back
    np.testing.assert_allclose(via_region, via_socket, rtol=1e-4, atol=1e-6)
    after = regions(caller)
    assert after["inputs"] == before["inputs"] + 1 and after["outputs"] == before["outputs"]


def test_many_threads_share_one_region(caller):
    """Threads place, wait and release concurrently; each gets its own rows (mlp: 1 KB rows, threshold 0)."""
    region = caller.region(1 << 20, threshold=0, output_bytes=output_bytes_for([8 * 10 * 4]))
    results, errors = {}, []

    def run(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for k in range(15):
                x = rng.standard_normal((8, 256), dtype=np.float32)
                results[seed, k] = (caller.infer("mlp", {"x": x}, region=region)["y"], x)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    for (seed, k), (y, x) in list(results.items())[:10]:   # the socket path gives the same rows
        np.testing.assert_allclose(y, caller.infer("mlp", {"x": x})["y"], rtol=1e-5, atol=1e-6)
    assert region.free_bytes() == region.nbytes
    region.close()


def test_outputs_into_the_region_and_the_fallback(caller):
    x = np.random.default_rng(1).standard_normal(IMAGE, dtype=np.float32)
    want = caller.infer("resnet224", {"image": x})["logits"]
    with caller.region(4 << 20, output_bytes=LOGITS) as region:
        before = regions(caller)
        call = prepare(1, "resnet224", {"image": x}, token=None, default_tenant=None, address="ipc://test", region=region)
        reply, frames = caller.call(call.msg, call.frames)
        meta = reply.outputs[0]
        assert meta.region == region.handle and meta.offset == call.msg.output_region.offset
        assert [f.bytes for f in frames] == [b""]              # the bytes came through the region
        np.testing.assert_allclose(call.outputs(reply, frames)["logits"], want, rtol=1e-4, atol=1e-6)
        region.release(call.slots)
        assert regions(caller)["outputs"] == before["outputs"] + 1
        region.output_bytes = 64                              # too small: the broker sends a frame
        got = caller.infer("resnet224", {"image": x}, region=region)["logits"]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
        assert regions(caller)["output_fallbacks"] == before["output_fallbacks"] + 1
        assert region.free_bytes() == region.nbytes


def test_unregistered_on_close_and_reregistered_after_unknown(caller):
    before = regions(caller)
    region = caller.region(1 << 20, threshold=0)
    assert regions(caller)["registered"] == before["registered"] + 1
    x = np.ones((2, 256), dtype=np.float32)
    # what a broker restart looks like to a client: the handle is unknown; reregister() recovers
    caller.send(UnregisterRegion(v=PROTOCOL_VERSION, id=0, region=region.handle))
    err = refused(lambda: caller.infer("mlp", {"x": x}, region=region))
    assert err.code.value == "INVALID_ARGUMENT" and err.details["reason"] == "unknown_region"
    old = region.handle
    region.reregister()
    assert region.handle != old
    np.testing.assert_allclose(caller.infer("mlp", {"x": x}, region=region)["y"], caller.infer("mlp", {"x": x})["y"],
                               rtol=1e-5, atol=1e-6)
    region.close()
    after = regions(caller)
    assert after["registered"] == before["registered"] and after["bytes"] == before["bytes"]
    assert after["unregistrations"] >= before["unregistrations"] + 2


def _infer_naming(caller, region_handle, *, offset=0, frame=b"", compression=None, output=None):
    x = np.ones((2, 256), dtype=np.float32)
    call = prepare(next(caller.ids), "mlp", {"x": x}, token=None, default_tenant=None, address="ipc://test")
    meta = call.msg.inputs[0]
    meta.region, meta.offset, meta.compression = region_handle, offset, compression
    call.msg.output_region = output
    return refused(lambda: caller.call(call.msg, [frame]))


def test_bad_references_are_refused(caller):
    with caller.region(1 << 20, threshold=0) as region:
        h = region.handle
        cases = {
            "unknown_region": _infer_naming(caller, 999_999),
            "region_bounds": _infer_naming(caller, h, offset=region.nbytes - 100),
            "region_encoding": _infer_naming(caller, h, compression="lz4"),
            "region_frame": _infer_naming(caller, h, frame=b"x" * 2048),
        }
        cases["output region_bounds"] = _infer_naming(
            caller, h, output=RegionSlice(region=h, offset=region.nbytes - 8, nbytes=64))
        cases["negative offset region_bounds"] = _infer_naming(caller, h, offset=-64)
    for want, err in cases.items():
        assert err.code.value == "INVALID_ARGUMENT", (want, err)
        assert err.details["reason"] == want.split()[-1], (want, err.message)
    assert "not registered" in cases["unknown_region"].message and "lz4" not in cases["region_bounds"].message


def test_unsealed_and_non_memfd_descriptors_are_refused(caller, tmp_path):
    before = regions(caller)
    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    plain = os.open(tmp_path / "plain", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, 1 << 16)
        os.ftruncate(plain, 1 << 16)
        for f, reason in ((fd, "region_unsealed"), (plain, "region_not_memfd"), (987, "region_fd")):
            err = refused(lambda: caller.send(RegisterRegion(v=PROTOCOL_VERSION, id=0, fd=f, nbytes=1 << 16)))
            assert (err.code.value, err.details["reason"]) == ("INVALID_ARGUMENT", reason), err.message
        with Region(caller.send, 1 << 16) as small:   # sealed, but smaller than it claims
            err = refused(lambda: caller.send(RegisterRegion(v=PROTOCOL_VERSION, id=0, fd=small.fd, nbytes=1 << 20)))
            assert err.details["reason"] == "region_size"
            err = refused(lambda: caller.send(RegisterRegion(v=PROTOCOL_VERSION, id=0, fd=small.fd, nbytes=1 << 40)))
            assert err.details["reason"] == "region_size" and err.details["limit"] == 64 << 20
    finally:
        os.close(fd)
        os.close(plain)
    assert regions(caller)["refused"] == before["refused"] + 5


def test_another_process_region_refused_then_swept_when_it_dies(caller, broker):
    before = regions(caller)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, broker.address], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        handle = json.loads(holder.stdout.readline())["region"]
        assert regions(caller)["registered"] == before["registered"] + 1
        err = _infer_naming(caller, handle)                 # same uid, another process: not ours to name
        assert err.details["reason"] == "region_owner"
        err = refused(lambda: caller.send(UnregisterRegion(v=PROTOCOL_VERSION, id=0, region=handle)))
        assert err.details["reason"] == "region_owner"
    finally:
        holder.kill()        # SIGKILL by PID: no unregistration
        holder.wait()
    swept = wait_until(lambda: (r := regions(caller))["swept"] == before["swept"] + 1 and r, what="the sweep")
    assert swept["registered"] == before["registered"]


def as_nobody(address: str) -> dict:
    """Register a region from a forked child running as uid 65534 (no exec: the interpreter
    may live where nobody cannot reach it); its answer, as a dict."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: nothing of the parent's ZeroMQ state is used here
        answer = {"code": "none"}
        try:
            os.close(r)
            os.setuid(65534)
            c = Caller(address)
            try:
                answer = {"region": c.region(1 << 20).handle}
            except TgwError as exc:
                answer = {"code": exc.code.value, "reason": exc.details.get("reason")}
        except BaseException as exc:  # noqa: BLE001
            answer = {"code": "child", "error": repr(exc)}
        finally:
            os.write(w, json.dumps(answer).encode())
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        text = f.read()
    os.waitpid(pid, 0)
    return json.loads(text)


def test_another_uid_is_refused(caller, broker):
    """The client runs as nobody (uid 65534); the socket is opened to it for this test only."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to run a client as another uid")
    sock = broker.address[len("ipc://"):]
    modes = os.stat(broker.dir).st_mode, os.stat(sock).st_mode
    before = regions(caller)
    os.chmod(broker.dir, 0o755)
    os.chmod(sock, 0o666)
    try:
        answer = as_nobody(broker.address)
    finally:
        os.chmod(broker.dir, modes[0] & 0o7777)
        os.chmod(sock, modes[1] & 0o7777)
    assert answer == {"code": "UNAUTHENTICATED", "reason": "region_uid"}
    assert regions(caller)["refused"] == before["refused"] + 1


def test_peer_address_parsing():
    class Header:
        def __init__(self, addr):
            self.addr = addr

        def get(self, key):
            assert key == "Peer-Address"
            return self.addr
    assert peer_of(Header("localhost:1000:1000:4242")) == (1000, 4242)
    # tcp peers (numeric, IPv6 too) have no credentials: regions need ipc://
    for addr in ("127.0.0.1", "2001:db8:0:1", "::1", "localhost:x:0:1", ""):
        assert peer_of(Header(addr)) is None


def test_allocator_quarantine_and_fallback():
    region = Region(None, 1 << 16, threshold=1024, output_bytes=4096)
    region.handle = 7                                       # placed as if registered
    calls = []
    x = np.zeros(4096, dtype=np.uint8)
    while True:
        call = prepare(len(calls) + 1, "m", {"x": x}, token=None, default_tenant=None, address="ipc://test", region=region)
        if call.msg.inputs[0].region is None:
            break
        calls.append(call)
    assert len(calls) == 8 and region.fallbacks >= 1 and len(call.frames[0]) == 4096
    ends = [c.slots for c in calls]
    region.release(ends[0], answered=True)                  # a reply came: all back
    region.release(ends[1])                                 # no reply: its output slice is quarantined
    assert region.free_bytes() == 2 * 4096 + 4096 and region.quarantined == 1
    region.late_reply(ends[1].req_id)
    assert region.free_bytes() == 4 * 4096
    for s in ends[2:]:
        region.release(s, answered=True)
    assert region.free_bytes() == region.nbytes and region._extents.free == [[0, region.nbytes]]
    assert isinstance(ends[0], Slots)
    region.close()


@pytest.mark.skipif(not hasattr(Client, "region"), reason="Client.region is wired by the client rewrite")
def test_client_region(broker):
    x = np.random.default_rng(2).standard_normal(IMAGE, dtype=np.float32)
    with Client(broker.address) as c:
        want = c.infer("resnet224", {"image": x})["logits"]
        region = c.region(4 << 20, output_bytes=LOGITS)
        got = c.infer("resnet224", {"image": x}, region=region)["logits"]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
        region.close()


def test_async_client_region(broker):
    aio = pytest.importorskip("tgw.client.aio")
    if not hasattr(aio.AsyncClient, "region"):
        pytest.skip("AsyncClient.region is wired by the client rewrite")
    import asyncio
    x = np.random.default_rng(3).standard_normal(IMAGE, dtype=np.float32)

    async def run():
        async with aio.AsyncClient(broker.address) as c:
            want = (await c.infer("resnet224", {"image": x}))["logits"]
            before = (await c.stats())["regions"]["registered"]
            region = await c.region(8 << 20, output_bytes=LOGITS)
            got = await asyncio.gather(*[c.infer("resnet224", {"image": x}, region=region) for _ in range(4)])
            for out in got:
                np.testing.assert_allclose(out["logits"], want, rtol=1e-4, atol=1e-6)
            assert region.free_bytes() == region.nbytes
            await region.aclose()
            assert (await c.stats())["regions"]["registered"] == before
    asyncio.run(run())
