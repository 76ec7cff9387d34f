"""Reduced wire precision (`wire_dtype`): float32 inputs sent as float16 or bfloat16 where the
model's config allows it (`models[].wire_dtypes`), widened back to float32 by the broker; the
bfloat16 rounding; torch tensors in (without a copy) and out (`return_type="torch"`)."""
from __future__ import annotations

import shutil
import sys
import tempfile

import lz4.frame
import numpy as np
import pytest
import torch
import zmq

from conftest import base_config, unloaded_model
from tgw.testing.child import BrokerProc
from tgw.broker.config.load import ConfigError, parse_config
from tgw.broker.models.checks import wire_nbytes
from tgw.broker.sched.inbound import tensor_bytes, widen
from tgw.broker.models.registry import Registry
from tgw.client import Client, InvalidArgumentError, InvalidInputDtypeError
from tgw.client.request import prepare
from tgw.client.tensors import as_array, encode, from_bfloat16_bits, to_bfloat16_bits, to_float16
from tgw.shm.errors import Code, TgwError
from tgw.shm.wire import PROTOCOL_VERSION, ErrorReply, Infer, ListModels, TensorMeta, encode as encode_msg, \
    reply_decoder

F32 = np.float32


def bits(*words: int) -> np.ndarray:
    """float32 values with these bit patterns."""
    return np.array(words, dtype=np.uint32).view(F32)


def torch_bf16(x: np.ndarray) -> np.ndarray:
    """x rounded to bfloat16 by torch, back as float32."""
    return torch.from_numpy(np.array(x)).to(torch.bfloat16).float().numpy()


# ---- bfloat16 rounding (client) ----------------------------------------------------------------

@pytest.mark.parametrize("word, want", [
    (0x3F800000, 0x3F80),   # 1.0 exactly
    (0x3F808000, 0x3F80),   # halfway between 0x3F80 and 0x3F81: ties to even (down)
    (0x3F818000, 0x3F82),   # halfway between 0x3F81 and 0x3F82: ties to even (up)
    (0x3F808001, 0x3F81),   # just above halfway: up
    (0x3F807FFF, 0x3F80),   # just below halfway: down
    (0xBF818000, 0xBF82),   # negative tie: the magnitude rounds as for the positive
    (0x7F7FFFFF, 0x7F80),   # float32's largest rounds past bfloat16's: +inf
    (0xFF7FFFFF, 0xFF80),   # and -inf
    (0x7F800000, 0x7F80),   # +inf stays
    (0xFF800000, 0xFF80),   # -inf stays
    (0x00000001, 0x0000),   # the smallest subnormal rounds to +0
    (0x80000000, 0x8000),   # -0 stays -0
    (0x007F8000, 0x0080),   # a subnormal tie rounds up to the smallest normal (even)
])
def test_bfloat16_rounding_edges(word, want):
    got = to_bfloat16_bits(bits(word))
    assert got.dtype == np.uint16 and int(got[0]) == want
    assert int(torch.from_numpy(bits(word)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)[0]) == want


@pytest.mark.parametrize("word", [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0x7F80FFFF])
def test_bfloat16_nan_stays_nan(word):
    """Every NaN stays a NaN (quiet, sign kept): 0x7F800001 would round to infinity otherwise."""
    got = to_bfloat16_bits(bits(word))
    back = from_bfloat16_bits(got)
    assert np.isnan(back[0])
    assert (int(got[0]) & 0x8000) == (word >> 16 & 0x8000)


def test_bfloat16_matches_torch_on_many_values():
    rng = np.random.default_rng(0)
    with np.errstate(over="ignore"):
        scaled = (rng.standard_normal(100_000) * 10.0 ** rng.integers(-40, 39, 100_000)).astype(F32)
    x = np.concatenate([scaled, rng.integers(0, 2**32, 100_000, dtype=np.uint64).astype(np.uint32).view(F32)])
    nan = np.isnan(x)
    got = from_bfloat16_bits(to_bfloat16_bits(x))
    np.testing.assert_array_equal(got[~nan], torch_bf16(x)[~nan])
    assert np.isnan(got[nan]).all()


def test_float16_with_and_without_torch_agree():
    """to_float16 casts with torch when the process has it loaded, else with numpy: same values."""
    rng = np.random.default_rng(5)
    with np.errstate(over="ignore"):
        x = (rng.standard_normal(200_000) * 10.0 ** rng.integers(-10, 7, 200_000)).astype(F32)
    x[:6] = [np.inf, -np.inf, 65504.0, 65520.0, 2.0 ** -25, -0.0]   # max, first to overflow, a subnormal tie
    via_torch = to_float16(x)
    with np.errstate(over="ignore"):
        via_numpy = x.astype(np.float16)
    assert "torch" in sys.modules   # this module imports it: the torch path ran
    np.testing.assert_array_equal(via_torch.view(np.uint16), via_numpy.view(np.uint16))
    readonly = x.copy()
    readonly.flags.writeable = False   # numpy's path (torch.from_numpy warns on read-only arrays)
    np.testing.assert_array_equal(to_float16(readonly).view(np.uint16), via_numpy.view(np.uint16))


def test_bfloat16_of_a_zero_dim_array():
    assert from_bfloat16_bits(to_bfloat16_bits(np.array(1.5, F32))) == 1.5


# ---- widening (broker) -------------------------------------------------------------------------

def test_widen_is_exact():
    rng = np.random.default_rng(1)
    half = rng.standard_normal(1000).astype(np.float16)
    np.testing.assert_array_equal(np.frombuffer(widen("float16", memoryview(half).cast("B")), F32),
                                  half.astype(F32))
    b16 = rng.integers(0, 2**16, 1000, dtype=np.uint64).astype(np.uint16)
    wide = np.frombuffer(widen("bfloat16", memoryview(b16).cast("B")), F32)
    np.testing.assert_array_equal(wide.view(np.uint32), b16.astype(np.uint32) << 16)


@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
@pytest.mark.parametrize("compress", [False, True])
def test_tensor_bytes_widens_after_inflating(wire, compress):
    x = np.linspace(-3, 3, 24, dtype=F32).reshape(2, 12)
    metas, frames, declared, sent = encode({"x": x}, compress, wire)
    meta = metas[0]
    assert (meta.dtype, meta.wire_dtype, meta.compression) == ("float32", wire, "lz4" if compress else None)
    assert declared == x.nbytes and wire_nbytes(meta) == x.nbytes // 2
    assert sent == (len(frames[0]) if compress else x.nbytes // 2)
    got = np.frombuffer(tensor_bytes(meta, memoryview(frames[0])), F32).reshape(x.shape)
    rounded = x.astype(np.float16).astype(F32) if wire == "float16" else torch_bf16(x)
    np.testing.assert_array_equal(got, rounded)


def test_lz4_frame_must_inflate_to_the_wire_size():
    meta = TensorMeta(name="x", dtype="float32", shape=[2, 4], compression="lz4", wire_dtype="float16")
    with pytest.raises(TgwError) as info:   # float32 bytes where float16 ones were declared
        tensor_bytes(meta, memoryview(lz4.frame.compress(np.zeros((2, 4), F32).tobytes())))
    assert info.value.code is Code.INVALID_ARGUMENT and "float16 (wire_dtype)" in info.value.message


# ---- client encode -----------------------------------------------------------------------------

def test_encode_narrows_only_float32():
    inputs = {"f32": np.ones((2, 3), F32), "f16": np.ones((2, 3), np.float16), "f64": np.ones((2, 3)),
              "i64": np.arange(6).reshape(2, 3)}
    metas, frames, declared, sent = encode(inputs, False, "bfloat16")
    by = {m.name: m for m in metas}
    assert by["f32"].wire_dtype == "bfloat16" and by["f32"].dtype == "float32" and len(frames[0]) == 12
    assert [by[n].wire_dtype for n in ("f16", "f64", "i64")] == [None, None, None]
    assert [by[n].dtype for n in ("f16", "f64", "i64")] == ["float16", "float64", "int64"]
    assert declared == sum(a.nbytes for a in inputs.values()) and sent == declared - 12


def test_encode_refuses_an_unknown_wire_dtype():
    with pytest.raises(InvalidArgumentError, match="wire_dtype"):
        encode({"x": np.ones((1, 2), F32)}, False, "int8")


def test_float16_overflow_is_infinity_without_warning():
    with np.errstate(all="raise"):
        metas, frames, _, _ = encode({"x": np.array([[1e6, -1e6, 1.0]], F32)}, False, "float16")
    np.testing.assert_array_equal(np.frombuffer(frames[0], np.float16), [np.inf, -np.inf, 1.0])


def test_cpu_torch_tensor_is_not_copied():
    t = torch.randn(8, 16)
    assert np.shares_memory(as_array("t", t), t.numpy())
    metas, frames, _, _ = encode({"t": t}, False)
    assert np.shares_memory(np.frombuffer(frames[0], F32), t.numpy())
    strided = torch.randn(16, 8).t()   # not contiguous: copied, values kept
    np.testing.assert_array_equal(as_array("s", strided), strided.numpy())


def test_torch_bfloat16_tensors():
    """bfloat16 torch tensors: with wire_dtype bfloat16, a float32 tensor's reduced precision (their
    bits as they are); else a bfloat16 tensor (dtype bfloat16, the same bits)."""
    t = torch.randn(3, 5).to(torch.bfloat16)
    exact = t.float().numpy()
    metas, frames, declared, sent = encode({"t": t}, False, "bfloat16")
    assert (metas[0].dtype, metas[0].wire_dtype, sent, declared) == ("float32", "bfloat16", 30, 60)
    np.testing.assert_array_equal(np.frombuffer(tensor_bytes(metas[0], memoryview(frames[0])), F32), exact.ravel())
    metas, frames, _, sent = encode({"t": t}, False)
    assert (metas[0].dtype, metas[0].wire_dtype, sent) == ("bfloat16", None, 30)
    np.testing.assert_array_equal(np.frombuffer(frames[0], np.uint16), t.view(torch.int16).numpy().view(np.uint16).ravel())
    metas, frames, _, _ = encode({"t": t.t()}, False, "bfloat16")   # not contiguous
    np.testing.assert_array_equal(from_bfloat16_bits(np.frombuffer(frames[0], np.uint16)), exact.T.ravel())


# ---- registry checks ---------------------------------------------------------------------------

@pytest.fixture
def reg(tmp_path) -> Registry:
    unloaded_model(tmp_path / "m.pt")
    io = {"inputs": [{"name": "x", "dtype": "float32", "shape": [4]}, {"name": "n", "dtype": "int64", "shape": [2]}],
          "outputs": [{"name": "y", "dtype": "float32", "shape": [4]}]}
    cfg = parse_config({"models": [
        {"name": "any", "versions": [{"version": "1", "path": "m.pt"}], **io, "wire_dtypes": ["float16", "bfloat16"]},
        {"name": "bf", "versions": [{"version": "1", "path": "m.pt"}], **io, "wire_dtypes": ["bfloat16"]},
        {"name": "none", "versions": [{"version": "1", "path": "m.pt"}], **io}]}, base_dir=str(tmp_path))
    r = Registry(cfg.models)
    for m in r.models.values():
        m.records["1"].seen = True
    return r


def request(model: str, x_wire=None, n_wire=None, compression=None) -> Infer:
    return Infer(v=PROTOCOL_VERSION, id=1, model=model, inputs=[
        TensorMeta(name="x", dtype="float32", shape=[3, 4], wire_dtype=x_wire, compression=compression),
        TensorMeta(name="n", dtype="int64", shape=[3, 2], wire_dtype=n_wire)])


def test_registry_takes_two_bytes_an_element(reg):
    assert reg.validate(request("any", "float16"), [24, 48]).rows == 3
    assert reg.validate(request("bf", "bfloat16"), [24, 48]).rows == 3
    assert reg.validate(request("any", "bfloat16", compression="lz4"), [7, 48]).rows == 3
    with pytest.raises(TgwError) as info:   # float32 bytes under a wire_dtype
        reg.validate(request("any", "float16"), [48, 48])
    assert info.value.code is Code.INVALID_ARGUMENT and info.value.details["expected"] == 24


@pytest.mark.parametrize("model, x_wire, n_wire, says", [
    ("none", "float16", None, "models[].wire_dtypes"),
    ("bf", "float16", None, "models[].wire_dtypes"),
    ("any", "float8", None, "unknown wire_dtype"),
    ("any", None, "float16", "only float32"),
])
def test_registry_refusals(reg, model, x_wire, n_wire, says):
    with pytest.raises(TgwError) as info:
        reg.validate(request(model, x_wire, n_wire), [24 if x_wire else 48, 24 if n_wire else 48])
    assert info.value.code is Code.INVALID_INPUT_DTYPE and says in info.value.message


def test_models_reply_lists_wire_dtypes(reg):
    assert reg.models["any"].info(True).wire_dtypes == ["float16", "bfloat16"]
    assert reg.models["none"].info(True).wire_dtypes == []


@pytest.mark.parametrize("entry, says", [
    ({"wire_dtypes": ["float8"]}, "unknown wire_dtypes"),
    ({"wire_dtypes": ["bfloat16"], "inputs": [{"name": "n", "dtype": "int64", "shape": [2]}]}, "no float32 input"),
])
def test_config_refuses(tmp_path, entry, says):
    unloaded_model(tmp_path / "m.pt")
    model = {"name": "m", "versions": [{"version": "1", "path": "m.pt"}],
             "inputs": [{"name": "x", "dtype": "float32", "shape": [4]}],
             "outputs": [{"name": "y", "dtype": "float32", "shape": [4]}], **entry}
    with pytest.raises(ConfigError, match=says):
        parse_config({"models": [model]}, base_dir=str(tmp_path))


# ---- end to end --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def broker(model_files):
    """mlp takes float16 and bfloat16, double only bfloat16, fails neither; mixed has no float32 input."""
    d = tempfile.mkdtemp(prefix="tgwp-", dir="/tmp")
    cfg = base_config(model_files, "mlp", "double", "fails", "mixed",
                      mlp={"wire_dtypes": ["float16", "bfloat16"]}, double={"wire_dtypes": ["bfloat16"]})
    b = BrokerProc(cfg, d).start()
    yield b
    code = b.stop()
    shutil.rmtree(d, ignore_errors=True)
    assert code == 0, b.output()


@pytest.fixture(scope="module")
def local(model_files):
    return {n: torch.jit.load(model_files[n][0]) for n in ("mlp", "double")}


def run_local(module, x: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return module(torch.from_numpy(np.array(x))).numpy()


def rounded(x: np.ndarray, wire: str) -> np.ndarray:
    return x.astype(np.float16).astype(F32) if wire == "float16" else torch_bf16(x)


@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
def test_results_are_the_model_on_rounded_inputs(broker, local, wire):
    x = np.random.default_rng(2).standard_normal((4, 256), dtype=F32)
    with Client(broker.address) as c:
        y = c.infer("mlp", {"x": x}, wire_dtype=wire)["y"]
        full = c.infer("mlp", {"x": x})["y"]
    np.testing.assert_allclose(y, run_local(local["mlp"], rounded(x, wire)), rtol=1e-5, atol=1e-6)
    assert not np.array_equal(y, full)   # the rounding did reach the model


@pytest.mark.parametrize("compress", [False, True])
def test_bfloat16_is_exact_through_an_exact_model(broker, local, compress):
    x = np.random.default_rng(3).standard_normal((2, 1000), dtype=F32)
    with Client(broker.address) as c:
        y = c.infer("double", {"x": x}, wire_dtype="bfloat16", compress=compress)["y"]
    np.testing.assert_array_equal(y, run_local(local["double"], torch_bf16(x)))


def test_torch_bfloat16_input_and_torch_outputs(broker, local):
    t = torch.randn(2, 300).to(torch.bfloat16)
    with Client(broker.address) as c:
        y = c.infer("double", {"x": t}, wire_dtype="bfloat16", return_type="torch")["y"]
        n = c.infer("double", {"x": t.float().numpy()})["y"]
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float32
    np.testing.assert_array_equal(y.numpy(), n)
    np.testing.assert_array_equal(n, t.float().numpy() * 2)


def test_return_type_torch_equals_numpy(broker):
    x = np.random.default_rng(4).standard_normal((3, 256), dtype=F32)
    with Client(broker.address) as c:
        as_torch = c.infer("mlp", {"x": torch.from_numpy(x)}, return_type="torch")["y"]
        as_numpy = c.infer("mlp", {"x": x})["y"]
    assert isinstance(as_torch, torch.Tensor) and isinstance(as_numpy, np.ndarray)
    np.testing.assert_array_equal(as_torch.numpy(), as_numpy)


def test_prepare_passes_wire_dtype():
    call = prepare(1, "mlp", {"x": np.ones((1, 256), F32)}, token=None, default_tenant=None, address="ipc://test", wire_dtype="float16")
    assert call.msg.inputs[0].wire_dtype == "float16" and call.sent == 512 and call.declared == 1024


@pytest.mark.parametrize("model, wire, says", [("fails", "float16", "models[].wire_dtypes"),
                                               ("double", "float16", "models[].wire_dtypes")])
def test_refused_where_the_config_does_not_allow_it(broker, model, wire, says):
    with Client(broker.address) as c:
        with pytest.raises(InvalidInputDtypeError, match=says.replace("[", r"\[").replace("]", r"\]")) as info:
            c.infer(model, {"x": np.ones((1, 2), F32)}, wire_dtype=wire)
    assert info.value.details["wire_dtype"] == wire


def raw(address: str, header, *frames):
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    try:
        s.send_multipart([encode_msg(header), *frames])
        assert s.poll(30_000), "no reply"
        return reply_decoder.decode(s.recv_multipart()[0])
    finally:
        s.close()
        ctx.term()


@pytest.mark.parametrize("wire, says", [("float16", "only float32"), ("float8", "unknown wire_dtype")])
def test_raw_refusals(broker, wire, says):
    """A raw client's wire_dtype on a float16 input, or an unknown one."""
    h = Infer(v=PROTOCOL_VERSION, id=7, model="mixed", inputs=[
        TensorMeta(name="a", dtype="float16", shape=[1, 4], wire_dtype=wire),
        TensorMeta(name="b", dtype="bool", shape=[1, 3]), TensorMeta(name="c", dtype="int64", shape=[1, 2])])
    reply = raw(broker.address, h, np.ones((1, 4), np.float16), np.ones((1, 3), bool), np.ones((1, 2), np.int64))
    assert isinstance(reply, ErrorReply) and reply.error.code == "INVALID_INPUT_DTYPE"
    assert says in reply.error.message


def test_models_list_wire_dtypes(broker):
    reply = raw(broker.address, ListModels(v=PROTOCOL_VERSION, id=3))
    by = {m.name: m.wire_dtypes for m in reply.models}
    assert by == {"mlp": ["float16", "bfloat16"], "double": ["bfloat16"], "fails": [], "mixed": []}
