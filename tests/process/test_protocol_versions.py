"""Protocol version 2 and its compatibility rule (docs/PROTOCOL.md section 6), with raw frames:
a version-1 request is served as before, an unknown version is refused naming the ones served,
and `cancel` answers for ids it does not hold."""
from __future__ import annotations

from msgspec import msgpack
import numpy as np
import zmq

from tgw.shm.wire import PROTOCOL_VERSION, SUPPORTED_VERSIONS

X = np.ones((1, 256), np.float32)


def ask(address: str, header: dict, *frames) -> tuple[dict, list]:
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        sock.send_multipart([msgpack.encode(header), *frames])
        assert sock.poll(10000), "no reply"
        reply, *tensors = sock.recv_multipart()
        return msgpack.decode(reply), tensors
    finally:
        ctx.destroy(linger=0)


def infer_header(v: int) -> dict:
    return {"op": "infer", "v": v, "id": 5, "model": "mlp",
            "inputs": [{"name": "x", "dtype": "float32", "shape": [1, 256]}]}


def test_version_1_clients_are_served_by_a_version_2_broker(shared_broker):
    assert PROTOCOL_VERSION == 2 and SUPPORTED_VERSIONS == (1, 2)
    for v in (1, 2):
        reply, frames = ask(shared_broker.address, infer_header(v), X.tobytes())
        assert reply["op"] == "infer" and reply["id"] == 5 and reply["v"] == 2
        assert np.frombuffer(frames[0], np.float32).shape == (10,)


def test_an_unknown_version_is_refused_naming_the_versions_served(shared_broker):
    reply, _ = ask(shared_broker.address, {**infer_header(3), "op": "teleport"})
    assert reply["op"] == "error" and reply["id"] == 5
    assert reply["error"]["code"] == "INVALID_ARGUMENT"
    assert reply["error"]["details"] == {"client_protocol": 3, "server_protocol": 2, "supported": [1, 2]}
    assert "client speaks 3, broker speaks 2 (and serves 1, 2)" in reply["error"]["message"]


def test_cancel_answers_for_ids_it_does_not_hold(shared_broker):
    reply, _ = ask(shared_broker.address, {"op": "cancel", "v": 2, "id": 9, "ids": [1, 2, 3]})
    assert reply == {"op": "cancel", "v": 2, "id": 9, "cancelled": 0}
