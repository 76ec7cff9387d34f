"""The committed gRPC messages are what scripts/gen-grpc.sh makes of the vendored protocol files:
the script runs here, into a temporary folder. (That they are Triton's own descriptors:
tests/unit/test_grpc_stubs.py.)"""
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
