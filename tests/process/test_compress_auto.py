"""`compress="auto"`: one rule (tgw.shm.compression) for the client's inputs and the broker's
outputs - large and compressible enough tensors only; off over ipc:// on the client's side."""
from __future__ import annotations

import shutil
import tempfile

import lz4.frame
import numpy as np
import pytest
import zmq

from conftest import base_config
from tgw.testing.child import BrokerProc
from tgw.broker.front.outbound import packed
from tgw.client import Client
from tgw.client.tensors import decode_outputs, encode
from tgw.shm.compression import AUTO_MAX_RATIO, AUTO_MIN_BYTES, STRIPE_BYTES, for_address, sample, worth_compressing
from tgw.shm.wire import PROTOCOL_VERSION, Infer, InferReply, encode as encode_msg, reply_decoder

F32 = np.float32
BIG = AUTO_MIN_BYTES // 4 * 2        # float32 elements: twice the threshold
rng = np.random.default_rng(0)


def lz4_len(b) -> int:
    return len(lz4.frame.compress(b))


def flat(a: np.ndarray) -> memoryview:
    return memoryview(a).cast("B")


# ---- the rule ----------------------------------------------------------------------------------

def test_rule_large_compressible_only():
    assert worth_compressing(flat(np.zeros(BIG, F32)), lz4_len)
    assert not worth_compressing(flat(np.zeros(AUTO_MIN_BYTES // 4 - 1, F32)), lz4_len)   # too small
    assert not worth_compressing(flat(rng.standard_normal(BIG).astype(F32)), lz4_len)    # incompressible
    assert not worth_compressing(flat(np.maximum(rng.standard_normal(BIG), 0).astype(F32)), lz4_len)  # ~0.67


def test_rule_threshold_is_the_sample_ratio():
    data = flat(np.zeros(BIG, F32))
    n = sum(p.nbytes for p in sample(data))
    assert worth_compressing(data, lambda b: int(b.nbytes * AUTO_MAX_RATIO))
    assert not worth_compressing(data, lambda b: int(b.nbytes * AUTO_MAX_RATIO) + 1)
    assert n == 4 * STRIPE_BYTES


def test_sample_spans_the_tensor():
    """Stripes from the start to the end: a zero head on random data does not fool the rule."""
    data = rng.standard_normal(BIG * 4).astype(F32)
    data[:BIG // 4] = 0
    parts = sample(flat(data))
    assert parts[0].tobytes() == flat(data)[:STRIPE_BYTES].tobytes()
    assert parts[-1].tobytes() == flat(data)[-STRIPE_BYTES:].tobytes()
    assert not worth_compressing(flat(data), lz4_len)


def test_small_tensor_sampled_whole():
    data = flat(np.zeros(100, F32))
    assert [p.nbytes for p in sample(data)] == [400]


@pytest.mark.parametrize("address, want", [("ipc:///tmp/x.sock", False), ("tcp://host:5555", "auto")])
def test_auto_is_off_over_ipc(address, want):
    assert for_address("auto", address) == want
    assert for_address(True, address) is True and for_address(False, address) is False


# ---- client side -------------------------------------------------------------------------------

def test_encode_auto_picks_tensors():
    inputs = {"zeros": np.zeros((1, BIG), F32), "small": np.zeros((1, 100), F32),
              "noise": rng.standard_normal((1, BIG)).astype(F32), "ints": np.repeat(np.arange(BIG // 64), 64)[None]}
    metas, frames, declared, sent = encode(inputs, "auto")
    assert {m.name: m.compression for m in metas} == {"zeros": "lz4", "small": None, "noise": None, "ints": "lz4"}
    assert declared == sum(a.nbytes for a in inputs.values()) and sent == sum(len(f) for f in frames)
    assert sent < declared - BIG * 4 * 0.9
    back = decode_outputs(metas, [bytes(f) for f in frames])
    for name, a in inputs.items():
        np.testing.assert_array_equal(back[name], a)


def test_encode_true_compresses_everything():
    metas, _, _, _ = encode({"small": np.zeros((1, 4), F32), "noise": rng.standard_normal((1, 8)).astype(F32)}, True)
    assert [m.compression for m in metas] == ["lz4", "lz4"]


def test_auto_with_wire_dtype_decides_on_the_narrowed_bytes():
    x = np.zeros((1, BIG), F32)   # 2 x AUTO_MIN_BYTES as float32, 1 x as float16: still large enough
    metas, frames, declared, sent = encode({"x": x}, "auto", "float16")
    assert (metas[0].compression, metas[0].wire_dtype) == ("lz4", "float16")
    metas, _, _, _ = encode({"x": x[:, :BIG // 2 - 8]}, "auto", "float16")   # under the threshold once narrowed
    assert metas[0].compression is None


def test_broker_packs_with_the_same_rule():
    zeros, noise = flat(np.zeros(BIG, F32)), flat(rng.standard_normal(BIG).astype(F32))
    assert packed("auto", zeros)[1] == "lz4"
    assert packed("auto", noise) == (noise, None)
    assert packed("auto", zeros[:1000]) == (zeros[:1000], None)
    assert packed(True, zeros[:1000])[1] == "lz4"


# ---- end to end: the broker's outputs ----------------------------------------------------------

@pytest.fixture(scope="module")
def broker(model_files):
    d = tempfile.mkdtemp(prefix="tgwz-", dir="/tmp")
    b = BrokerProc(base_config(model_files, "double"), d).start()
    yield b
    code = b.stop()
    shutil.rmtree(d, ignore_errors=True)
    assert code == 0, b.output()


def ask(address: str, x: np.ndarray, compress_outputs, compression=None):
    """One raw request to "double" (y = 2x); the reply and its outputs."""
    metas, frames, _, _ = encode({"x": x}, compression or False)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    try:
        s.send_multipart([encode_msg(Infer(v=PROTOCOL_VERSION, id=1, model="double", inputs=metas,
                                           compress_outputs=compress_outputs)), *frames])
        assert s.poll(30_000), "no reply"
        parts = s.recv_multipart()
    finally:
        s.close()
        ctx.term()
    reply = reply_decoder.decode(parts[0])
    assert isinstance(reply, InferReply), reply
    return reply, decode_outputs(reply.outputs, parts[1:]), [len(p) for p in parts[1:]]


@pytest.mark.parametrize("kind, compress_outputs, want", [
    ("zeros", "auto", "lz4"),
    ("noise", "auto", None),
    ("small", "auto", None),
    ("noise", True, "lz4"),
    ("small", True, "lz4"),
    ("zeros", False, None),
])
def test_broker_auto_outputs(broker, kind, compress_outputs, want):
    x = {"zeros": np.zeros((1, BIG), F32), "noise": rng.standard_normal((1, BIG)).astype(F32),
         "small": np.zeros((1, 64), F32)}[kind]
    reply, out, sizes = ask(broker.address, x, compress_outputs)
    assert reply.outputs[0].compression == want
    np.testing.assert_array_equal(out["y"], x * 2)
    if kind == "zeros" and want:
        assert sizes[0] < x.nbytes * AUTO_MAX_RATIO


def test_client_auto_end_to_end(broker):
    x = np.zeros((2, BIG), F32)
    x[:, ::7] = 1.0
    with Client(broker.address) as c:
        y = c.infer("double", {"x": x}, compress="auto")["y"]
    np.testing.assert_array_equal(y, x * 2)


def test_compressed_input_auto_output(broker):
    x = np.tile(np.arange(256, dtype=F32), (1, BIG // 256))
    reply, out, _ = ask(broker.address, x, "auto", compression=True)
    assert reply.outputs[0].compression == "lz4"
    np.testing.assert_array_equal(out["y"], x * 2)
