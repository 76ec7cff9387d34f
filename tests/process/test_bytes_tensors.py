"""bytes tensors end to end through stages (tests/stages.py's Echo and Upper) served by one real
broker: the native client with numpy object arrays and lists of str, tritonclient.http with BYTES
in JSON and in binary, and hostile bytes frames sent raw over the native socket (bad length
prefixes, an element over server.max_element_bytes, element counts that disagree with the shape),
each answered with its error while the broker keeps serving."""
from __future__ import annotations

import itertools
import json
import os
import shutil
import struct
import tempfile
import urllib.error
import urllib.request

import lz4.frame
import numpy as np
import pytest
import tritonclient.http as httpclient
import zmq

import stages
from tgw.client import Client
from tgw.shm.bytes_tensor import pack
from tgw.shm.wire import PROTOCOL_VERSION, ErrorReply, Infer, InferReply, TensorMeta, encode, reply_decoder
from conftest import served

MAX_ELEMENT = 4096
_ids = itertools.count(1)


@pytest.fixture(scope="module")
def broker():
    d = tempfile.mkdtemp(prefix="tgwy-", dir="/tmp")
    os.makedirs(os.path.join(d, "stages"))
    shutil.copy(stages.__file__, os.path.join(d, "stages", "stages.py"))
    handler = "stages/stages.py"
    cfg = {"model_roots": [d],
           "workers": {"devices": ["cpu"], "threads_per_worker": 1, "input_arena_mb": 4, "output_arena_mb": 4},
           "server": {"max_element_bytes": MAX_ELEMENT, "max_request_bytes": 1 << 20},
           "http": {"port": 0},
           "models": [stages.stage_entry(handler, "Echo"), stages.stage_entry(handler, "Upper")]}
    yield from served(cfg, d, http=True)


def test_native_client_object_arrays_and_lists_of_str(broker):
    with Client(broker.address) as c:
        arr = np.array([b"\x00\xffbinary", b"", b"x" * 3000], dtype=object)
        out = c.infer("echo", {"data": arr})
        assert out["data"].dtype == object and out["data"].tolist() == arr.tolist()
        assert out["length"].tolist() == [8, 0, 3000]
        up = c.infer("upper", {"data": ["héllo", "world"]})["data"]
        assert up.tolist() == ["HéLLO".encode(), b"WORLD"]   # bytes.upper() leaves non-ASCII alone
        big = c.infer("echo", {"data": [b"ab" * 1000] * 8}, compress=True)   # lz4 both ways
        assert big["data"].tolist() == [b"ab" * 1000] * 8


def test_tritonclient_bytes_in_json_and_binary(broker):
    c = httpclient.InferenceServerClient(broker.http.removeprefix("http://"))
    try:
        for binary in (False, True):
            x = httpclient.InferInput("data", [3], "BYTES")
            x.set_data_from_numpy(np.array([b"abc", "é".encode(), b""], dtype=object), binary_data=binary)
            outputs = [httpclient.InferRequestedOutput("data", binary_data=binary),
                       httpclient.InferRequestedOutput("length", binary_data=binary)]
            result = c.infer("upper" if binary else "echo", [x], outputs=outputs[:1] if binary else outputs)
            data = result.as_numpy("data")
            if binary:
                assert data.tolist() == [b"ABC", "é".encode(), b""]
            else:   # JSON strings: tritonclient reads them as str
                assert data.tolist() == ["abc", "é", ""] and result.as_numpy("length").tolist() == [3, 2, 0]
        meta = c.get_model_metadata("echo")
        assert meta["inputs"][0]["datatype"] == "BYTES"
    finally:
        c.close()


def http_infer(broker, doc: dict) -> tuple[int, dict]:
    req = urllib.request.Request(f"{broker.http}/v2/models/echo/infer", data=json.dumps(doc).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_bytes_that_are_no_utf8_need_binary_over_http(broker):
    raw = pack([b"\xff\xfe"])
    header = json.dumps({"inputs": [{"name": "data", "shape": [1], "datatype": "BYTES",
                                     "parameters": {"binary_data_size": len(raw)}}],
                         "outputs": [{"name": "data"}]}).encode()
    req = urllib.request.Request(f"{broker.http}/v2/models/echo/infer", data=header + raw, method="POST",
                                 headers={"Inference-Header-Content-Length": str(len(header))})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    assert info.value.code == 400 and "binary_data" in json.loads(info.value.read())["error"]
    status, doc = http_infer(broker, {"inputs": [{"name": "data", "shape": [2], "datatype": "BYTES",
                                                  "data": ["a", "bc"]}]})
    assert status == 200 and doc["outputs"][0]["data"] == ["a", "bc"]


LEN = struct.Struct("<I").pack


def ask(sock: zmq.Socket, shape: list, frame: bytes, compression=None):
    header = Infer(v=PROTOCOL_VERSION, id=next(_ids), model="echo", inputs=[
        TensorMeta(name="data", dtype="bytes", shape=shape, compression=compression)])
    sock.send_multipart([encode(header), frame])
    assert sock.poll(30_000), "no answer within 30 s"
    parts = sock.recv_multipart()
    return reply_decoder.decode(parts[0]), parts[1:]


@pytest.mark.parametrize("shape, frame, code, words", [
    ([1], b"\x02\x00", "INVALID_ARGUMENT", "inside its 4-byte length"),
    ([1], LEN(1 << 30) + b"abc", "INVALID_ARGUMENT", "only 3 bytes follow"),
    ([2], pack([b"a"]) + b"\x01\x00\x00", "INVALID_ARGUMENT", "inside its 4-byte length"),
    ([1], pack([b"a"]) + b"tail", "INVALID_ARGUMENT", "4 bytes follow the last"),
    ([1], pack([b"a", b"b"]), "INVALID_ARGUMENT", "follow the last of the 1 elements"),
    ([3], pack([b"a", b"b"]), "INVALID_ARGUMENT", "element 2 of 3"),
    ([1], pack([b"x" * (MAX_ELEMENT + 1)]), "PAYLOAD_TOO_LARGE", "server.max_element_bytes"),
    ([1, 1], pack([b"a"]), "INVALID_INPUT_SHAPE", "unexpected shape for input"),
])
def test_hostile_bytes_frames_are_answered_and_the_broker_serves_on(broker, shape, frame, code, words):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(broker.address)
    try:
        reply, _ = ask(sock, shape, frame)
        assert isinstance(reply, ErrorReply) and reply.error.code == code and words in reply.error.message, reply
        reply, frames = ask(sock, [2], pack([b"still", b"here"]))   # the same connection is served on
        assert isinstance(reply, InferReply) and bytes(frames[0]) == pack([b"still", b"here"])
        bomb = lz4.frame.compress(bytes(2 << 20))   # 2 MiB of zeros in a few KiB: past max_request_bytes
        reply, _ = ask(sock, [1], bomb, compression="lz4")
        assert isinstance(reply, ErrorReply) and reply.error.code == "PAYLOAD_TOO_LARGE"
    finally:
        sock.close()
        ctx.term()
