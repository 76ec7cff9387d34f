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
    assert resp.error_message == "slow" and resp.infer_response.id == "req-7"
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


def test_a_slow_reader_is_withdrawn_and_a_cancelled_stream_withdraws_the_rest():
    """infer.Stream's wiring, its door recorded: a client that reads nothing (every write waits)
    leaves outputs unread past generator.max_unread_outputs, so the generation is withdrawn
    (slow_reader); cancelling the call withdraws the generations it still holds."""
    import asyncio
    from types import SimpleNamespace

    from tgw.broker.config.load import ModelDecl
    from tgw.broker.faces.grpc.infer import Inference, Stream
    from tgw.broker.models.entry import ModelEntry
    from tgw.testing.generators import entry as generator_entry
    gen = ModelEntry(ModelDecl(**generator_entry("g", max_unread_outputs=4)))
    handed, withdrawn = [], []
    deps = SimpleNamespace(view=SimpleNamespace(pipelines=SimpleNamespace(table={})), entry=lambda m: gen,
                           infer=lambda caller, msg, frames, *route: handed.append((caller, msg)),
                           withdraw=lambda caller, reason: withdrawn.append((caller, reason)),
                           count_error=lambda *a: None, note=lambda *a, **k: None)
    face = SimpleNamespace(deps=deps, decl=SimpleNamespace(max_inflight=100), repository=None, shm=None)

    class Context:   # a client that never reads: every write waits
        def invocation_metadata(self):
            return ()

        def time_remaining(self):
            return None

        async def write(self, resp):
            await asyncio.Event().wait()

    def request(rid: str) -> pb.ModelInferRequest:
        req = pb.ModelInferRequest(model_name="g", id=rid)
        req.inputs.add(name="prompt", datatype="INT64", shape=[1, 1])
        req.raw_input_contents.append(np.array([[3]], np.int64).tobytes())
        req.parameters["max_tokens"].int64_param = 50
        return req

    async def run():
        async def requests():
            yield request("slow")
            yield request("other")
            await asyncio.Event().wait()   # the client's sending side stays open
        task = asyncio.ensure_future(Stream(Inference(face), Context()).run(requests()))
        while len(handed) < 2:
            await asyncio.sleep(0)
        (slow, msg), (other, _) = handed
        assert msg.generate.max_outputs == 50 and msg.generate.sampling.temperature == 0.0
        out = GenerateOutputs(v=PROTOCOL_VERSION, id=1, first=0, count=1,
                              outputs=[TensorMeta(name="value", dtype="int64", shape=[1])])
        for i in range(6):   # the first is being written (forever); five more left unread
            slow.deliver(out, [np.array([i], np.int64).tobytes()])
            await asyncio.sleep(0)
        while not withdrawn:
            await asyncio.sleep(0)
        assert withdrawn == [(slow, "slow_reader")]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (other, "grpc_cancelled") in withdrawn
    asyncio.run(asyncio.wait_for(run(), 60))   # a bound, so a broken wiring fails, never hangs
