"""The committed gRPC messages are Triton's own: the same descriptors as tritonclient's generated
modules. (That they are what scripts/gen-grpc.sh makes of the vendored protocol files:
tests/process/test_grpc_generation.py.)"""


def test_descriptors_are_tritons():
    from tgw.broker.faces.grpc.proto import grpc_service_pb2, model_config_pb2
    from tritonclient.grpc import model_config_pb2 as triton_config, service_pb2 as triton_service
    assert grpc_service_pb2.DESCRIPTOR.serialized_pb == triton_service.DESCRIPTOR.serialized_pb
    assert model_config_pb2.DESCRIPTOR.serialized_pb == triton_config.DESCRIPTOR.serialized_pb
    assert "GRPCInferenceService" in grpc_service_pb2.DESCRIPTOR.services_by_name
