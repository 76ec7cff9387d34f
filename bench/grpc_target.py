"""The gRPC rows' targets: KServe v2 ModelInfer on tgw's gRPC face, as tritonclient.grpc sends it
(inputs in raw_input_contents, outputs back raw), one channel (one HTTP/2 connection) per caller
coroutine, as the HTTP rows hold one keep-alive connection per caller: unary calls (`infer`), or
one ModelStreamInfer stream per caller, a request written and its answer read in turn
(`start_stream` + `async_stream_infer`, perf_analyzer's --streaming). The callers are grpc.aio
coroutines on one loop per generator process (loadgen's `async_caller`): Python's leanest gRPC
client (its synchronous one spends more CPU per call, which on a small box is taken from the
server being measured).

The request is serialized once per caller and the reply is not parsed beyond its status (the
generator's CPU would otherwise be measured with the server's); `check()` parses one reply in
full, before the window, so a row never counts answers that are wrong. grpc is imported in the
generator's (spawned) processes only: a gRPC channel does not survive a fork.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from tgw.bench.targets import CallError, make_inputs, v2_datatype

METHOD = "/inference.GRPCInferenceService/ModelInfer"
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"


def infer_request(model: str, inputs: dict) -> Any:
    from tgw.broker.faces.grpc.proto import grpc_service_pb2 as pb
    tensors = [pb.ModelInferRequest.InferInputTensor(name=k, datatype=v2_datatype(v.dtype), shape=list(v.shape))
               for k, v in inputs.items()]
    raw = [v.astype(v.dtype.newbyteorder("<"), copy=False).tobytes() for v in inputs.values()]
    return pb.ModelInferRequest(model_name=model, inputs=tensors, raw_input_contents=raw)


@dataclass
class GrpcTarget:
    address: str               # host:port of the gRPC face
    model: str
    meta: dict[str, Any]       # the model's declaration (its inputs), as the other targets read it
    timeout: float = 30.0
    label: str = "tgw_grpc"

    def open(self, seed: int) -> "GrpcTarget":
        self.seed, self.channels = seed, []
        return self

    def channel(self):
        import grpc
        # a local subchannel pool: each caller its own connection, not one shared by every channel
        channel = grpc.aio.insecure_channel(self.address, options=[("grpc.use_local_subchannel_pool", 1),
                                                                   ("grpc.max_receive_message_length", -1),
                                                                   ("grpc.max_send_message_length", -1)])
        self.channels.append(channel)
        return channel

    async def aclose(self) -> None:
        """On the callers' loop, before it closes: the channels (and their streams) end cleanly."""
        for channel in self.channels:
            await channel.close()

    def body(self, index: int) -> bytes:
        return infer_request(self.model, make_inputs(self.meta, 1, self.seed * 1000 + index)).SerializeToString()

    async def async_caller(self, index: int) -> Callable[[], Awaitable[None]]:
        import grpc
        body, timeout = self.body(index), self.timeout
        call = self.channel().unary_unary(METHOD)   # bytes in, bytes out: no (de)serializer
        self.check(await call(body, timeout=timeout))

        async def infer() -> None:
            try:
                await call(body, timeout=timeout)
            except grpc.RpcError as err:
                raise CallError(err.code().name, err.details() or "") from None
        return infer

    def check(self, reply: bytes) -> None:
        """One reply in full: every declared output, with as many raw bytes as its shape says."""
        from tgw.broker.faces.grpc.proto import grpc_service_pb2 as pb
        import numpy as np
        msg = pb.ModelInferResponse.FromString(reply)
        names = [o.name for o in msg.outputs]
        wanted = [o["name"] for o in self.meta["outputs"]]
        if sorted(names) != sorted(wanted) or len(msg.raw_output_contents) != len(names):
            raise CallError("BAD_REPLY", f"outputs {names}, raw contents {len(msg.raw_output_contents)}; "
                                         f"declared {wanted}")
        for out, raw in zip(msg.outputs, msg.raw_output_contents):
            itemsize = np.dtype(next(o["dtype"] for o in self.meta["outputs"] if o["name"] == out.name)).itemsize
            if len(raw) != itemsize * int(np.prod(out.shape)):
                raise CallError("BAD_REPLY", f"output {out.name}: {len(raw)} bytes for shape {list(out.shape)}")

    def close(self) -> None:
        pass  # the process exits next, which closes its channels


@dataclass
class GrpcStreamTarget(GrpcTarget):
    label: str = "tgw_grpc_stream"

    async def async_caller(self, index: int) -> Callable[[], Awaitable[None]]:
        import grpc
        from tgw.broker.faces.grpc.proto import grpc_service_pb2 as pb
        body = self.body(index)
        stream = self.channel().stream_stream(STREAM)()   # bytes both ways
        await stream.write(body)
        first = pb.ModelStreamInferResponse.FromString(await stream.read())
        if first.error_message:
            raise CallError("STREAM_ERROR", first.error_message)
        self.check(first.infer_response.SerializeToString())

        async def infer() -> None:
            try:
                await stream.write(body)
                answer = await stream.read()
            except grpc.RpcError as err:
                raise CallError(err.code().name, err.details() or "") from None
            if answer[:1] == b"\n":   # field 1's tag (error_message): set only on an error answer
                raise CallError("STREAM_ERROR", pb.ModelStreamInferResponse.FromString(answer).error_message)
        return infer
