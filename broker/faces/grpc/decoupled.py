"""A generator's request on a ModelStreamInfer stream, answered as Triton answers for a model with
a decoupled transaction policy: one ModelStreamInferResponse per output position, in order.

The door answers a generation with GenerateOutputs (`count` positions, each tensor
[count, *declared]) and then GenerateEnd (protocol/streaming.py's StreamCaller reads them). Each
position becomes one response carrying the request's `id`, the model's name and version and its
outputs shaped [1, *declared], as a decoupled Triton model's batch-1 responses are. Every
response carries `triton_final_response` as Triton's stream handler sets it: false on a data
response (the end is only known at GenerateEnd, after the last output went), true on the
empty final response a request asks for with `triton_enable_empty_final_response: true`, and
true on an error, which ends that request only (its `error_message`; the stream goes on).

A pump per generation reads its StreamCaller and waits until its responses are written, so a
client that reads slowly leaves outputs unread in the caller; past the model's
`generator.max_unread_outputs` the caller ends OVERLOADED and is withdrawn (its slot freed).
"""
from __future__ import annotations

from tgw.shm.errors import Code, TgwError, fail
from tgw.shm.wire import GenerateEnd, GenerateOutputs

from tgw.broker.protocol.errors import details
from tgw.broker.protocol.kserve import DATATYPE_OF
from tgw.broker.protocol.streaming import StreamCaller

from . import tensors
from .proto import grpc_service_pb2 as pb

FINAL = "triton_final_response"
EMPTY_FINAL = "triton_enable_empty_final_response"
TGW_CODE = "tgw_code"
# Triton's wording (src/grpc/infer_handler.cc), answered UNIMPLEMENTED as Triton's UNSUPPORTED is
UNARY_REFUSED = "ModelInfer RPC doesn't support models with decoupled transaction policy"


def wants_empty_final(req: pb.ModelInferRequest) -> bool:
    p = req.parameters.get(EMPTY_FINAL)
    if p is None:
        return False
    if p.WhichOneof("parameter_choice") != "bool_param":
        raise fail(Code.INVALID_ARGUMENT, f"parameter {EMPTY_FINAL} must be a boolean", parameter=EMPTY_FINAL)
    return p.bool_param


def check(entry, decoded: tensors.Decoded) -> None:
    """What a generation over gRPC cannot ask for: outputs into shared memory, unknown outputs."""
    if decoded.places:
        raise fail(Code.INVALID_ARGUMENT, "a generation's outputs stream back in its responses: no shared-memory "
                   "output regions", reason="generate_transport", model=entry.name)
    declared = [t.name for t in entry.outputs]
    unknown = [n for n in decoded.infer.outputs or () if n not in declared]
    if unknown:
        raise fail(Code.INVALID_ARGUMENT, f"model {entry.name!r} has no output(s) {unknown}; it has {declared}",
                   model=entry.name)


def response(decoded: tensors.Decoded, version: str, final: bool) -> pb.ModelInferResponse:
    infer = pb.ModelInferResponse(model_name=decoded.infer.model, model_version=version, id=decoded.request_id)
    infer.parameters[FINAL].bool_param = final
    return infer


def split(msg: GenerateOutputs, frames: list, decoded: tensors.Decoded,
          version: str) -> list[pb.ModelStreamInferResponse]:
    """One response per output position, each tensor [1, *declared] (only the outputs asked for)."""
    wanted = decoded.infer.outputs
    metas = [(meta, frame) for meta, frame in zip(msg.outputs, frames) if not wanted or meta.name in wanted]
    out = []
    for i in range(msg.count):
        infer = response(decoded, version, False)
        for meta, frame in metas:
            size = len(frame) // msg.count
            infer.outputs.add(name=meta.name, datatype=DATATYPE_OF[meta.dtype], shape=[1, *meta.shape[1:]])
            infer.raw_output_contents.append(frame[i * size:(i + 1) * size])
        out.append(pb.ModelStreamInferResponse(infer_response=infer))
    return out


def error(err: TgwError, decoded: tensors.Decoded, version: str) -> pb.ModelStreamInferResponse:
    infer = response(decoded, version, True)
    infer.parameters[TGW_CODE].string_param = err.code.value
    return pb.ModelStreamInferResponse(error_message=details(err), infer_response=infer)


async def pump(stream, caller: StreamCaller, decoded: tensors.Decoded, version: str, empty_final: bool) -> None:
    """Write a generation's answers on `stream` (infer.Stream) until its last one; `version`: the
    version shown until GenerateEnd names the one that ran."""
    try:
        while True:
            try:
                msg, frames = await caller.next()
            except TgwError as err:
                stream.send([error(err, decoded, version)])
                return
            if type(msg) is GenerateOutputs:
                await stream.sent(split(msg, frames, decoded, version))
            elif type(msg) is GenerateEnd:
                if empty_final:
                    stream.send([pb.ModelStreamInferResponse(infer_response=response(decoded, msg.version, True))])
                return
            else:   # a whole reply in one answer: it is the last
                infer = tensors.encode(msg, frames, decoded)
                infer.parameters[FINAL].bool_param = True
                stream.send([pb.ModelStreamInferResponse(infer_response=infer)])
                return
    except Exception as exc:  # a broker bug: this request answered, the stream goes on
        stream.deps.note("broker_error", type(exc).__name__, "gRPC decoupled answer failed inside the broker",
                         exc_info=True)
        if not caller.done:
            stream.deps.withdraw(caller, "broker_error")
        stream.send([error(fail(Code.INTERNAL, f"broker error: {type(exc).__name__}: {exc}"), decoded, version)])
    finally:
        stream.finished(caller)
