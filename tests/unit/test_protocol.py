"""The seams of the face-neutral protocol layer (broker/protocol/) that the faces used to hold:
the door port and its awaited caller, each code's gRPC status as data, the shared-memory route,
the repository without a face, and the gRPC face's parameters read by the HTTP face's rules."""
from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import orjson
import pytest

from tgw.broker.front.cuda_route import REGISTERED
from tgw.broker.protocol import door, errors, triton_shm
from tgw.broker.protocol.repository import Repository
from tgw.shm.errors import Code, TgwError, fail
from tgw.shm.wire import PROTOCOL_VERSION, CudaIpc, ErrorReply, Infer, TensorMeta


def port(dispatch) -> door.DoorPort:
    nothing = lambda *a, **k: None   # noqa: E731
    return door.DoorPort(token=None, view=None, entry=nothing, dispatch=dispatch, infer=nothing,
                         count_error=nothing, note=nothing, withdraw=nothing)


class Caller(door.AwaitedCaller):
    __slots__ = ()
    face = "test"


def test_ask_answers_the_reply_and_raises_an_error_reply():
    async def run():
        loop = asyncio.get_running_loop()
        frame = bytearray(b"abc")
        answered = await door.ask(port(lambda caller, msg: caller.deliver("reply", [memoryview(frame)])), "msg",
                                  Caller(loop))
        frame[:] = b"xyz"   # the ring block is released after deliver: the caller kept a copy
        err = fail(Code.MODEL_NOT_FOUND, "no model 'm'", model="m")
        refused = port(lambda caller, msg: caller.deliver(ErrorReply(v=PROTOCOL_VERSION, id=1, error=err.to_body()),
                                                          []))
        with pytest.raises(TgwError) as info:
            await door.ask(refused, "msg", Caller(loop))
        return answered, info.value
    (reply, frames), err = asyncio.run(run())
    assert reply == "reply" and frames == [b"abc"] and type(frames[0]) is bytes
    assert err.code is Code.MODEL_NOT_FOUND and err.details == {"model": "m"}


def test_an_awaited_caller_takes_one_answer_and_names_its_face():
    async def run():
        caller = Caller(asyncio.get_running_loop())
        caller.deliver("first", [])
        caller.deliver("second", [])   # a late answer (the handler is gone) is dropped, not raised
        return caller, await caller.future
    caller, answer = asyncio.run(run())
    assert answer == ("first", []) and repr(caller) == "test"
    with pytest.raises(AttributeError):   # slots: one attribute per request, as the hot path wants
        caller.other = 1


def test_the_door_port_is_a_frozen_record_with_the_faces_fields():
    fields = [f.name for f in dataclasses.fields(door.DoorPort)]
    assert fields == ["token", "view", "entry", "dispatch", "infer", "count_error", "note", "withdraw", "shm", "load",
                      "scrape", "uploads"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        port(None).token = "x"


def test_every_code_has_a_grpc_status_by_name():
    import grpc
    assert set(errors.GRPC_STATUS) == set(Code)
    assert all(name in grpc.StatusCode.__members__ for name in errors.GRPC_STATUS.values())
    assert errors.grpc_status(fail(Code.OVERLOADED, "busy")) == "RESOURCE_EXHAUSTED"
    assert errors.grpc_status(fail(Code.MODEL_NOT_READY, "later")) == "UNAVAILABLE"
    err = fail(Code.INVALID_INPUT_SHAPE, "bad shape", input="x")
    assert errors.details(err) == "bad shape"   # as Triton's: the code rides in the trailers
    assert errors.trailers(err, "00-trace") == (("tgw-code", "INVALID_INPUT_SHAPE"), ("tgw-retryable", "false"),
                                                ("tgw-details", '{"input":"x"}'), ("traceparent", "00-trace"))
    assert orjson.loads(errors.error_body(err)) == {"error": "bad shape", "code": "INVALID_INPUT_SHAPE",
                                                    "retryable": False, "details": {"input": "x"}}


def test_route_vouches_for_cuda_regions_whichever_face_decoded_them():
    cuda = CudaIpc(device=0, device_uuid="", handle=bytes(64), storage_bytes=8, storage_offset_bytes=0)
    msg = Infer(v=PROTOCOL_VERSION, id=1, model="m", inputs=[TensorMeta(name="x", dtype="float32", shape=[2])])
    plain = SimpleNamespace(infer=msg, places={"y": triton_shm.Place("y", "sys", 0, 8)})
    assert triton_shm.route(plain) == () and msg.output_cuda == {}
    on_gpu = SimpleNamespace(infer=msg, places={"y": triton_shm.Place("y", "g", 0, 8, cuda)})
    assert triton_shm.route(on_gpu) == (REGISTERED,) and msg.output_cuda == {"y": cuda}
    assert triton_shm.written(None, SimpleNamespace(places={}), None, []) == {}


def test_the_repository_refuses_control_beyond_loopback_without_a_token():
    def refused(host, token):
        repo = Repository(None, None, None, host, token, "a test face")
        try:
            repo.control_allowed()
        except TgwError as err:
            assert err.code is Code.UNAUTHENTICATED and "a test face" in err.message
            return True
        return False
    assert refused("0.0.0.0", None) and not refused("0.0.0.0", "secret")
    assert not refused("127.0.0.1", None) and not refused("localhost", None) and not refused("::1", None)


def test_repository_parameters_as_both_faces_send_them():
    assert Repository.params({"version": "2", "weight": 10, "shadow": "0.25"}) == \
        {"version": "2", "weight": 10, "shadow": 0.25}   # gRPC's repository parameters have no double
    with pytest.raises(TgwError, match="unknown parameter 'config'"):   # config and files: uploads.split's
        Repository.params({"config": "{}"})
    with pytest.raises(TgwError, match="unknown parameter 'path'"):
        Repository.params({"path": "x"}, ("version", "unload_dependents"))


def test_the_grpc_face_refuses_what_http_refuses_but_leaves_regions_to_itself():
    from tgw.broker.faces.grpc import tensors
    tensors.refuse_unoffered({"classification": 3}, "")   # offered now (protocol/classification.py)
    tensors.refuse_unoffered({"shared_memory_region": "r", "priority": 1}, "input 'x': ", input="x")


def test_sequence_and_generate_parameters_are_read_the_same_on_every_face():
    from tgw.broker.protocol.streaming import generate_params, sequence_ref
    assert sequence_ref({}) is None and sequence_ref({"sequence_id": 0}) is None
    ref = sequence_ref({"sequence_id": 7, "sequence_start": True})
    assert (ref.id, ref.start, ref.end) == (7, True, False)
    assert sequence_ref({"sequence_id": "abc", "sequence_end": True}).id == "abc"
    for bad_params, word in [({"sequence_id": -1}, "uint64"), ({"sequence_id": 1.5}, "uint64"),
                             ({"sequence_id": 3, "sequence_start": 1}, "boolean"),
                             ({"sequence_id": 0, "sequence_start": True}, "non-zero")]:
        with pytest.raises(TgwError, match=word):
            sequence_ref(bad_params)
    g = generate_params({"max_tokens": 5, "temperature": 0.5, "seed": 3, "stop_tokens": 9})
    assert (g.max_outputs, g.sampling.temperature, g.sampling.seed, g.sampling.stop_tokens) == (5, 0.5, 3, [9])
    with pytest.raises(TgwError, match="one limit"):
        generate_params({"max_tokens": 5, "max_outputs": 5})
    with pytest.raises(TgwError, match="an integer"):
        generate_params({"top_k": "3"})


def test_model_level_errors_in_tritons_words_and_status():
    """Triton core's texts (model_repository_manager.cc, model_lifecycle.cc, server common.cc),
    which Triton's clients and qa tests match; tgw's code and message stay in the details."""
    def answer(code, message, **d):
        return errors.triton_answer(fail(code, message, **d))
    assert answer(Code.MODEL_NOT_FOUND, "no model named 'x'", model="x") == \
        ("Request for unknown model: 'x' is not found", 404, "NOT_FOUND")
    assert answer(Code.VERSION_NOT_FOUND, "no version", model="x", version="99") == \
        ("Request for unknown model: 'x' version 99 is not found", 404, "NOT_FOUND")
    assert answer(Code.VERSION_NOT_FOUND, "no version", model="x", version="abc") == \
        ("failed to get model version from specified version string 'abc' (details: stol), version should be an "
         "integral value > 0", 400, "INVALID_ARGUMENT")
    assert answer(Code.VERSION_NOT_FOUND, "no version", model="x", version="-3").message == \
        "invalid model version specified '-3' , version should be an integral value > 0"
    assert answer(Code.MODEL_NOT_READY, "none loaded", model="x", reason="no_version") == \
        ("Request for unknown model: 'x' has no available versions", 404, "NOT_FOUND")
    assert answer(Code.MODEL_NOT_READY, "loading", model="x", version="2") == \
        ("Request for unknown model: 'x' version 2 is not at ready state", 503, "UNAVAILABLE")
    # tgw's own situations keep tgw's words and status
    assert answer(Code.MODEL_NOT_READY, "crash loop", model="x", reason="crash_loop") == \
        ("crash loop", 503, "UNAVAILABLE")
    assert answer(Code.OVERLOADED, "busy") == ("busy", 429, "RESOURCE_EXHAUSTED")
    err = fail(Code.MODEL_NOT_FOUND, "no model named 'x'", model="x")
    assert orjson.loads(errors.error_body(err)) == {
        "error": "Request for unknown model: 'x' is not found", "code": "MODEL_NOT_FOUND", "retryable": False,
        "details": {"model": "x", "tgw_message": "no model named 'x'"}}
    assert errors.headers(err) == {"tgw-code": "MODEL_NOT_FOUND", "tgw-retryable": "false"}
    assert errors.details(err) == "Request for unknown model: 'x' is not found"


def test_grpc_tensors_read_classification_and_word_the_checks_as_triton():
    from tgw.broker.faces.grpc import tensors
    from tgw.broker.faces.grpc.proto import grpc_service_pb2 as pb
    req = pb.ModelInferRequest(model_name="m")
    req.inputs.add(name="x", datatype="INT64", shape=[1, 3]).contents.int64_contents.extend([1, 2, 3])
    out = req.outputs.add(name="y")
    out.parameters["classification"].int64_param = 2   # tritonclient's class_count
    assert tensors.decode(req, 1, None).classes == {"y": 2}
    req.raw_input_contents.append(bytes(24))
    with pytest.raises(TgwError) as info:
        tensors.decode(req, 1, None)
    assert info.value.message == "contents field must not be specified when using raw_input_contents for 'x' for " \
        "model 'm'"
    del req.raw_input_contents[:]
    req.inputs[0].shape[:] = [1, 4]
    with pytest.raises(TgwError) as info:
        tensors.decode(req, 1, None)
    assert info.value.message == "input byte size mismatch for input 'x' for model 'm'. Expected 32, got 24"
    req.inputs[0].ClearField("contents")
    with pytest.raises(TgwError) as info:
        tensors.decode(req, 1, None)
    assert info.value.message == "unable to find data for input tensor 'x' for model 'm' in request."
