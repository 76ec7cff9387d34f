"""Every bad input gets its structured error, and the broker serves the next good request."""
from __future__ import annotations

import msgspec
import numpy as np
import pytest
import zmq

from tgw.client import Client, ConnectError, TgwError
from tgw.shm.errors import Code
from tgw.shm.wire import PROTOCOL_VERSION, ErrorReply, Infer, TensorMeta, encode, reply_decoder

X = np.zeros((2, 256), np.float32)


@pytest.fixture(scope="module")
def client(shared_broker):
    with Client(shared_broker.address) as c:
        yield c


def expect(client, code: Code, model: str, inputs: dict, **kw) -> TgwError:
    with pytest.raises(TgwError) as info:
        client.infer(model, inputs, **kw)
    err = info.value
    assert err.code == code, f"{err.code}: {err.message}"
    assert err.message
    assert client.infer("mlp", {"x": X})["y"].shape == (2, 10)  # the broker keeps serving
    return err


CASES = {
    "unknown model": (Code.MODEL_NOT_FOUND, "nope", {"x": X}, {}),
    "unknown version": (Code.VERSION_NOT_FOUND, "mlp", {"x": X}, {"version": "9"}),
    "wrong dtype": (Code.INVALID_INPUT_DTYPE, "mlp", {"x": X.astype(np.float64)}, {}),
    "wrong rank": (Code.INVALID_INPUT_SHAPE, "mlp", {"x": np.zeros(256, np.float32)}, {}),
    "wrong dim": (Code.INVALID_INPUT_SHAPE, "mlp", {"x": np.zeros((2, 255), np.float32)}, {}),
    "batch over max": (Code.INVALID_INPUT_SHAPE, "mlp", {"x": np.zeros((65, 256), np.float32)}, {}),
    "empty batch": (Code.INVALID_INPUT_SHAPE, "mlp", {"x": np.zeros((0, 256), np.float32)}, {}),
    "batch dims disagree": (Code.INVALID_INPUT_SHAPE, "mixed", {
        "a": np.zeros((2, 4), np.float16), "b": np.zeros((3, 3), bool), "c": np.zeros((2, 5), np.int64)}, {}),
    "missing input": (Code.INVALID_ARGUMENT, "mixed", {"a": np.zeros((2, 4), np.float16)}, {}),
    "extra input": (Code.INVALID_ARGUMENT, "mlp", {"x": X, "z": X}, {}),
    "unknown output": (Code.INVALID_ARGUMENT, "mlp", {"x": X}, {"outputs": ["nope"]}),
    "oversized payload": (Code.PAYLOAD_TOO_LARGE, "embed", {"tokens": np.zeros((32, 20000), np.int64)}, {}),
    "model raises": (Code.MODEL_EXECUTION_ERROR, "fails", {"x": np.full((1, 2), -1, np.float32)}, {}),
    "negative timeout": (Code.INVALID_ARGUMENT, "mlp", {"x": X}, {"timeout": -1}),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_request_gets_structured_error(client, case):
    code, model, inputs, kw = CASES[case]
    if case == "negative timeout":  # one rule on both sides: the client refuses it, so does the broker
        _raw_negative_timeout(client)
    err = expect(client, code, model, inputs, **kw)
    assert err.http_status in (400, 404, 413, 500)
    if code == Code.MODEL_NOT_FOUND:  # counted although no served model is named
        assert client.stats()["errors"]["MODEL_NOT_FOUND"] >= 1


def _raw_negative_timeout(client):
    reply = raw_call(client.address, [encode(Infer(v=PROTOCOL_VERSION, id=5, model="mlp", timeout_ms=-5, inputs=[
        TensorMeta(name="x", dtype="float32", shape=[2, 256])])), X.tobytes()])
    assert isinstance(reply, ErrorReply) and reply.error.code == "INVALID_ARGUMENT"


def test_model_error_message_reaches_caller(client):
    err = expect(client, Code.MODEL_EXECUTION_ERROR, "fails", {"x": np.full((1, 2), -1, np.float32)})
    assert "negative input rejected by model" in err.message
    np.testing.assert_array_equal(client.infer("fails", {"x": np.ones((1, 2), np.float32)})["y"], [[2, 2]])


def raw_call(address: str, frames: list, timeout_ms: int = 10000):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    try:
        s.send_multipart(frames)
        assert s.poll(timeout_ms), "no reply"
        parts = s.recv_multipart()
        return reply_decoder.decode(parts[0])
    finally:
        s.close()


def _infer_header(**kw) -> bytes:
    fields = dict(v=PROTOCOL_VERSION, id=7, model="mlp", inputs=[TensorMeta(name="x", dtype="float32", shape=[2, 256])])
    fields.update(kw)
    return encode(Infer(**fields))


RAW = {
    "malformed msgpack": [b"\xc1\xff\x00garbage"],
    "header not a map": [msgspec.msgpack.encode([1, 2, 3])],
    "unknown op": [msgspec.msgpack.encode({"op": "launch", "v": 1, "id": 3})],
    "wrong field type": [msgspec.msgpack.encode({"op": "infer", "v": 1, "id": 3, "model": 5, "inputs": []})],
    "frame length mismatch": [_infer_header(), b"\x00" * 100],
    "missing tensor frame": [_infer_header()],
    "unknown dtype": [_infer_header(inputs=[TensorMeta(name="x", dtype="complex64", shape=[2, 256])]),
                      b"\x00" * 4096],
    "bad lz4": [_infer_header(inputs=[TensorMeta(name="x", dtype="float32", shape=[2, 256], compression="lz4")]),
                b"not lz4 at all"],
    "unknown compression": [_infer_header(inputs=[TensorMeta(name="x", dtype="float32", shape=[2, 256],
                                                            compression="zstd")]), b"\x00" * 2048],
}


@pytest.mark.parametrize("case", RAW)
def test_raw_bad_message(shared_broker, client, case):
    reply = raw_call(shared_broker.address, RAW[case])
    assert isinstance(reply, ErrorReply), reply
    assert reply.error.code in ("INVALID_ARGUMENT", "INVALID_INPUT_DTYPE"), reply.error
    assert reply.error.message
    assert client.infer("mlp", {"x": X})["y"].shape == (2, 10)


def test_wrong_protocol_version(shared_broker, client):
    reply = raw_call(shared_broker.address, [_infer_header(v=PROTOCOL_VERSION + 1), X.tobytes()])
    assert isinstance(reply, ErrorReply) and reply.error.code == "INVALID_ARGUMENT"
    assert "protocol version" in reply.error.message
    assert reply.error.details["server_protocol"] == PROTOCOL_VERSION
    assert reply.id == 7
    assert client.infer("mlp", {"x": X})["y"].shape == (2, 10)


def test_newer_protocol_with_unknown_message_names_the_version(shared_broker):
    reply = raw_call(shared_broker.address, [msgspec.msgpack.encode({"op": "capabilities", "v": 99, "id": 4})])
    assert isinstance(reply, ErrorReply) and "protocol version mismatch" in reply.error.message
    assert reply.id == 4


def test_lz4_bomb_is_refused_without_inflating(shared_broker, client):
    import lz4.frame
    bomb = lz4.frame.compress(bytes(200 << 20))  # 200 MB of zeros in under 1 MB
    reply = raw_call(shared_broker.address, [_infer_header(inputs=[
        TensorMeta(name="x", dtype="float32", shape=[2, 256], compression="lz4")]), bomb])
    assert isinstance(reply, ErrorReply) and reply.error.code == "INVALID_ARGUMENT"
    assert "decompress" in reply.error.message
    assert client.infer("mlp", {"x": X})["y"].shape == (2, 10)


def test_request_over_max_request_bytes(client):
    big = np.zeros((64, 20000), np.float32)  # 5 MB > server.max_request_bytes (4 MiB)
    err = expect(client, Code.PAYLOAD_TOO_LARGE, "mlp", {"x": big})
    assert err.details["limit"] == 4 << 20


def test_unsupported_dtype_rejected_in_client(client):
    with pytest.raises(TgwError) as info:
        client.infer("mlp", {"x": np.zeros((1, 256), np.complex64)})
    assert info.value.code == Code.INVALID_INPUT_DTYPE


def test_no_broker_is_a_clear_error(short_dir):
    with pytest.raises(ConnectError, match="no tgw broker"):
        Client(f"ipc://{short_dir}/absent.sock")
