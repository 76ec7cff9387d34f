#!/usr/bin/env bash
# Regenerate the gRPC face's protobuf modules from the vendored protocol files:
#   bash scripts/gen-grpc.sh [OUT_DIR]     (default: broker/faces/grpc/proto, where they are committed)
# The .proto files are Triton's, unchanged (triton-inference-server/common, protobuf/, commit
# 83adf7c): the same file names and contents as tritonclient's, so both sets of generated modules
# can live in one process (protobuf's pool accepts a file added twice only when it is identical).
# Only messages are generated: the service is served by grpc's generic handlers (faces/grpc/face.py).
# protoc writes `import model_config_pb2`; the sed makes it the package-relative import.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-broker/faces/grpc/proto}"
python="${PYTHON:-.venv/bin/python}"
mkdir -p "$out"
"$python" -m grpc_tools.protoc -I broker/faces/grpc/proto --python_out="$out" \
    broker/faces/grpc/proto/grpc_service.proto broker/faces/grpc/proto/model_config.proto
sed -i 's/^import model_config_pb2 as /from . import model_config_pb2 as /' "$out/grpc_service_pb2.py"
