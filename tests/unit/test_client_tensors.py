"""The client's tensors (client/tensors.py, client/bytes_tensors.py): bytes tensors from numpy
arrays and nested lists, bfloat16 from ml_dtypes and torch, replies decoded back; and what the
client refuses, naming the tensor."""
from __future__ import annotations

import lz4.frame
import ml_dtypes
import numpy as np
import pytest
import torch

from tgw.client.cuda import CudaPlan, place_cuda
from tgw.client.regions import Region
from tgw.client.request import as_torch, prepare
from tgw.client.tensors import decode_outputs, encode
from tgw.shm.bytes_tensor import pack, unpack
from tgw.shm.errors import Code, TgwError
from tgw.shm.wire import TensorMeta

BF16 = ml_dtypes.bfloat16


def one(value, compress=False, wire_dtype=None):
    metas, frames, declared, sent = encode({"t": value}, compress, wire_dtype)
    return metas[0], bytes(frames[0]), declared, sent


@pytest.mark.parametrize("value, shape", [
    ([b"a", b"bc"], [2]),
    (["x", "ü"], [2]),                                           # str: UTF-8
    ([[b"a", "b"], [b"", b"dd"]], [2, 2]),                       # nested lists: their nesting is the shape
    ((b"a", b"b"), [2]),
    (np.array([b"a", b"b\x00c"], dtype=object), [2]),           # object arrays keep every byte
    (np.array([["p", "q"]], dtype=object), [1, 2]),
    (np.array([b"ab", b"c"]), [2]),                              # numpy bytes_ (S) and str_ (U) arrays
    (np.array(["ab", "c"]), [2]),
    (np.array([[b"a"], [b"b"]], dtype=object).T, [1, 2]),       # any memory order: read in C order
    (b"solo", []),
])
def test_bytes_values_encode_in_c_order(value, shape):
    meta, frame, declared, sent = one(value)
    assert (meta.dtype, meta.shape, meta.wire_dtype) == ("bytes", shape, None)
    flat = np.array(value, dtype=object).ravel().tolist() if shape else [value]
    assert unpack(frame, len(flat)) == [v.encode() if isinstance(v, str) else bytes(v) for v in flat]
    assert declared == sent == len(frame)


def test_bytes_replies_decode_to_object_arrays_of_bytes():
    items = [b"a", b"", "é".encode(), b"\xff\x00"]
    out = decode_outputs([TensorMeta(name="y", dtype="bytes", shape=[2, 2])], [pack(items)])["y"]
    assert out.dtype == object and out.shape == (2, 2) and out.ravel().tolist() == items
    assert all(type(v) is bytes for v in out.ravel())
    packed = lz4.frame.compress(pack(items))
    again = decode_outputs([TensorMeta(name="y", dtype="bytes", shape=[4], compression="lz4")], [packed])["y"]
    assert again.tolist() == items


def test_a_malformed_bytes_reply_is_an_internal_error():
    with pytest.raises(TgwError) as info:
        decode_outputs([TensorMeta(name="y", dtype="bytes", shape=[2])], [pack([b"a"])])
    assert info.value.code is Code.INTERNAL and "'y'" in info.value.message


def test_bytes_round_trip_compressed_and_wire_dtype_leaves_them_alone():
    meta, frame, declared, _ = one([b"x" * 1000] * 4, compress=True, wire_dtype="bfloat16")
    assert (meta.dtype, meta.compression, meta.wire_dtype) == ("bytes", "lz4", None)
    assert declared == len(pack([b"x" * 1000] * 4)) and unpack(lz4.frame.decompress(frame), 4) == [b"x" * 1000] * 4


@pytest.mark.parametrize("value, code, words", [
    ([[b"a", b"b"], [b"c"]], Code.INVALID_INPUT_SHAPE, "not a regular array"),
    ([[b"a"], b"b"], Code.INVALID_INPUT_SHAPE, "not a regular array"),
    ([b"a", [b"b"]], Code.INVALID_INPUT_SHAPE, "nest deeper"),
    ([b"a", 3], Code.INVALID_INPUT_DTYPE, "element 1 (C order) is int"),
    (np.array([b"a", 2.5], dtype=object), Code.INVALID_INPUT_DTYPE, "is float, not bytes or str"),
])
def test_bad_bytes_values_are_refused_by_name(value, code, words):
    with pytest.raises(TgwError) as info:
        one(value)
    assert info.value.code is code and "'t'" in info.value.message and words in info.value.message, \
        info.value.message


def test_numeric_lists_still_go_as_numbers():
    meta, frame, _, _ = one([[1.0, 2.0]])
    assert (meta.dtype, meta.shape) == ("float64", [1, 2])
    assert one([])[0].dtype == "float64"


def test_ml_dtypes_bfloat16_arrays_go_as_bfloat16_and_come_back():
    x = np.array([[1.5, -2.0, 3.0e38, np.inf]], dtype=np.float32).astype(BF16)
    meta, frame, declared, sent = one(x)
    assert (meta.dtype, meta.shape, meta.wire_dtype, declared, sent) == ("bfloat16", [1, 4], None, 8, 8)
    assert frame == x.tobytes()
    back = decode_outputs([meta], [frame])["t"]
    assert back.dtype == BF16 and back.shape == (1, 4) and back.tobytes() == x.tobytes()
    strided = np.arange(8, dtype=np.float32).astype(BF16).reshape(2, 4).T   # not contiguous: copied
    meta, frame, _, _ = one(strided)
    assert meta.shape == [4, 2] and frame == np.ascontiguousarray(strided).tobytes()


def test_torch_bfloat16_goes_as_bfloat16_and_as_float32_under_a_wire_dtype():
    t = torch.randn(3, 5).to(torch.bfloat16)
    bits = t.view(torch.int16).numpy().tobytes()
    meta, frame, declared, sent = one(t)
    assert (meta.dtype, meta.wire_dtype, declared, sent, frame) == ("bfloat16", None, 30, 30, bits)
    meta, frame, declared, _ = one(t, wire_dtype="bfloat16")   # as before tgw carried bfloat16
    assert (meta.dtype, meta.wire_dtype, declared, frame) == ("float32", "bfloat16", 60, bits)
    meta, frame, declared, _ = one(t, wire_dtype="float16")    # its float32 values, rounded to float16
    assert (meta.dtype, meta.wire_dtype, declared) == ("float32", "float16", 60)
    assert frame == t.float().numpy().astype(np.float16).tobytes()


def test_return_type_torch_holds_bfloat16_and_leaves_bytes_as_arrays():
    x = np.array([1.5, -3.25], dtype=np.float32).astype(BF16)
    t = as_torch(x)
    assert t.dtype == torch.bfloat16 and t.float().tolist() == [1.5, -3.25]
    objects = np.array([b"a"], dtype=object)
    assert as_torch(objects) is objects


def test_regions_leave_bytes_tensors_in_frames():
    region = Region(None, 1 << 20, threshold=16, register=False)
    try:
        region.handle = 1   # as registered: place() then uses it
        call = prepare(1, "m", {"b": [b"x" * 64] * 4, "f": np.zeros(64, np.float32)}, token=None,
                       default_tenant=None, address="ipc:///tmp/none", region=region)
        by = {m.name: m for m in call.msg.inputs}
        assert by["b"].region is None and len(call.frames[0]) == 4 * 68    # bytes: still in its frame
        assert by["f"].region == 1 and call.frames[1] == b""                # a fixed-size one: in the region
        with pytest.raises(TgwError) as info:
            region.read_outputs([TensorMeta(name="o", dtype="bytes", shape=[1], region=1)], [b""])
        assert "'o'" in info.value.message and "frames" in info.value.message
    finally:
        region.close(unregister=False)


def test_bytes_inputs_cannot_ride_with_cuda_inputs():
    call = prepare(1, "m", {"b": [b"x"]}, token=None, default_tenant=None, address="ipc:///tmp/none")
    with pytest.raises(TgwError) as info:   # refused before any CUDA tensor is looked at
        place_cuda(call, {"c": object()})
    assert info.value.code is Code.INVALID_ARGUMENT and "'b' is a bytes tensor" in info.value.message
    assert isinstance(place_cuda(call, {}), CudaPlan)   # without CUDA inputs: nothing to refuse
