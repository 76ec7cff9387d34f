"""A generation's answers as decoupled gRPC responses (broker/faces/grpc/decoupled.py), pure: a
GenerateOutputs of several positions split one response each, in order, each tensor [1, *shape],
only the outputs asked for; the final flag, the empty-final parameter and the refusals."""
from __future__ import annotations

import numpy as np
import pytest

from tgw.broker.faces.grpc import decoupled
from tgw.broker.faces.grpc.proto import grpc_service_pb2 as pb
from tgw.broker.faces.grpc.tensors import Decoded
from tgw.shm.errors import Code, TgwError, fail
from tgw.shm.wire import PROTOCOL_VERSION, GenerateOutputs, Infer, TensorMeta

pytestmark = pytest.mark.unit


def decoded(outputs=None, places=None) -> Decoded:
    return Decoded(Infer(v=PROTOCOL_VERSION, id=1, model="gpt", inputs=[], outputs=outputs), [], "req-7",
                   places or {})


def test_outputs_split_one_response_per_position():
    tokens = np.array([5, 6, 7], np.int64)
    probs = np.arange(6, dtype=np.float32).reshape(3, 2)
    msg = GenerateOutputs(v=PROTOCOL_VERSION, id=1, first=4, count=3,
                          outputs=[TensorMeta(name="token", dtype="int64", shape=[3]),
                                   TensorMeta(name="probs", dtype="float32", shape=[3, 2])])
    out = decoupled.split(msg, [tokens.tobytes(), probs.tobytes()], decoded(), "1")
    assert len(out) == 3
    for i, resp in enumerate(out):
        r = resp.infer_response
        assert (r.id, r.model_name, r.model_version, resp.error_message) == ("req-7", "gpt", "1", "")
        assert r.parameters[decoupled.FINAL].bool_param is False
        assert [(o.name, o.datatype, list(o.shape)) for o in r.outputs] == [("token", "INT64", [1]),
                                                                            ("probs", "FP32", [1, 2])]
        assert np.frombuffer(r.raw_output_contents[0], np.int64).tolist() == [5 + i]
        assert np.frombuffer(r.raw_output_contents[1], np.float32).tolist() == probs[i].tolist()
    only = decoupled.split(msg, [tokens.tobytes(), probs.tobytes()], decoded(outputs=["probs"]), "1")
    assert [o.name for o in only[2].infer_response.outputs] == ["probs"]


def test_an_error_is_final_and_names_its_code():
    resp = decoupled.error(fail(Code.OVERLOADED, "slow"), decoded(), "1")
    assert resp.error_message == "[OVERLOADED] slow" and resp.infer_response.id == "req-7"
    assert resp.infer_response.parameters[decoupled.FINAL].bool_param is True
    assert resp.infer_response.parameters["tgw_code"].string_param == "OVERLOADED"


def test_request_checks():
    req = pb.ModelInferRequest(model_name="gpt")
    assert decoupled.wants_empty_final(req) is False
    req.parameters[decoupled.EMPTY_FINAL].bool_param = True
    assert decoupled.wants_empty_final(req) is True
    req.parameters[decoupled.EMPTY_FINAL].string_param = "yes"
    with pytest.raises(TgwError, match="must be a boolean"):
        decoupled.wants_empty_final(req)

    class Entry:
        name = "gpt"
        outputs = [TensorMeta(name="token", dtype="int64", shape=[])]
    decoupled.check(Entry, decoded(outputs=["token"]))
    with pytest.raises(TgwError, match=r"no output\(s\) \['nope'\]"):
        decoupled.check(Entry, decoded(outputs=["nope"]))
    with pytest.raises(TgwError, match="no shared-memory output regions"):
        decoupled.check(Entry, decoded(places={"token": object()}))
