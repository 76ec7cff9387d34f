"""The committed gRPC messages are what scripts/gen-grpc.sh makes of the vendored protocol files,
and they are Triton's own: the same descriptors as tritonclient's generated modules."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO = ROOT / "broker" / "faces" / "grpc" / "proto"


def test_committed_messages_match_a_fresh_generation(tmp_path):
    subprocess.run(["bash", str(ROOT / "scripts" / "gen-grpc.sh"), str(tmp_path)], check=True,
                   env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
    for name in ("grpc_service_pb2.py", "model_config_pb2.py"):
        assert (tmp_path / name).read_text() == (PROTO / name).read_text(), f"{name}: run scripts/gen-grpc.sh"


def test_descriptors_are_tritons():
    from tgw.broker.faces.grpc.proto import grpc_service_pb2, model_config_pb2
    from tritonclient.grpc import model_config_pb2 as triton_config, service_pb2 as triton_service
    assert grpc_service_pb2.DESCRIPTOR.serialized_pb == triton_service.DESCRIPTOR.serialized_pb
    assert model_config_pb2.DESCRIPTOR.serialized_pb == triton_config.DESCRIPTOR.serialized_pb
    assert "GRPCInferenceService" in grpc_service_pb2.DESCRIPTOR.services_by_name
