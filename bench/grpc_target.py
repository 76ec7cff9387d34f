"""The gRPC rows' target: KServe v2 ModelInfer on tgw's gRPC face, as tritonclient.grpc sends it
(inputs in raw_input_contents, outputs back raw), one channel (one HTTP/2 connection) per caller
thread, as the HTTP rows hold one keep-alive connection per caller.

The request is serialized once per caller and the reply is not parsed beyond its status (the
generator's CPU would otherwise be measured with the server's); `check()` parses one reply in
full, before the window, so a row never counts answers that are wrong. grpc is imported in the
generator's (spawned) processes only: a gRPC channel does not survive a fork.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from tgw.bench.targets import CallError, make_inputs, v2_datatype

METHOD = "/inference.GRPCInferenceService/ModelInfer"


def infer_request(model: str, inputs: dict) -> Any:
    from tgw.broker.grpc_face.proto import grpc_service_pb2 as pb
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
        self.seed = seed
        return self

    def channel(self):
        import grpc
        # a local subchannel pool: each caller its own connection, not one shared by every channel
        return grpc.insecure_channel(self.address, options=[("grpc.use_local_subchannel_pool", 1),
                                                            ("grpc.max_receive_message_length", -1),
                                                            ("grpc.max_send_message_length", -1)])

    def caller(self, index: int) -> Callable[[], None]:
        import grpc
        body = infer_request(self.model, make_inputs(self.meta, 1, self.seed * 1000 + index)).SerializeToString()
        call = self.channel().unary_unary(METHOD)   # bytes in, bytes out: no (de)serializer
        timeout = self.timeout
        self.check(call(body, timeout=timeout))

        def infer() -> None:
            try:
                call(body, timeout=timeout)
            except grpc.RpcError as err:
                raise CallError(err.code().name, err.details() or "") from None
        return infer

    def check(self, reply: bytes) -> None:
        """One reply in full: every declared output, with as many raw bytes as its shape says."""
        from tgw.broker.grpc_face.proto import grpc_service_pb2 as pb
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
