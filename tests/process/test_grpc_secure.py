"""The gRPC face behind a token and TLS (a self-signed certificate the openssl CLI makes here),
with client shared memory left off: tritonclient.grpc with ssl=True, grpcio's health stub."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.utils import InferenceServerException

from conftest import base_config, served
from tgw.client import Client

TOKEN = "grpc-s3cret-token"
BEARER = {"authorization": f"Bearer {TOKEN}"}
OPENSSL = shutil.which("openssl")
pytestmark = pytest.mark.skipif(OPENSSL is None, reason="needs the openssl CLI to make a certificate")


@pytest.fixture(scope="module")
def broker(model_files):
    d = tempfile.mkdtemp(prefix="tgws-", dir="/tmp")
    subprocess.run([OPENSSL, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", os.path.join(d, "key.pem"),
                    "-out", os.path.join(d, "cert.pem")], check=True, capture_output=True, timeout=60)
    with open(os.path.join(d, "token"), "w") as f:
        f.write(TOKEN + "\n")
    os.chmod(os.path.join(d, "token"), 0o600)
    cfg = base_config(model_files, "mlp", server={"auth_token_file": os.path.join(d, "token")})
    cfg["grpc"] = {"port": 0, "tls_cert_file": "cert.pem", "tls_key_file": "key.pem"}   # relative: to the config
    gen = served(cfg, d)
    os.environ["TGW_TOKEN"] = TOKEN   # the native client's
    try:
        b = next(gen)
        with Client(b.address) as c:
            b.grpc = c.status()["grpc"]
        b.cert_path = os.path.join(d, "cert.pem")
        with open(b.cert_path, "rb") as f:
            b.cert = f.read()
        yield b
        next(gen, None)
    finally:
        os.environ.pop("TGW_TOKEN", None)


@pytest.fixture(scope="module")
def triton(broker):
    c = grpcclient.InferenceServerClient(broker.grpc.replace("127.0.0.1", "localhost"), ssl=True,
                                         root_certificates=broker.cert_path)
    yield c
    c.close()


def test_token_required_health_open(broker, triton):
    x = grpcclient.InferInput("x", [1, 256], "FP32")
    x.set_data_from_numpy(np.zeros((1, 256), np.float32))
    with pytest.raises(InferenceServerException) as err:
        triton.infer("mlp", [x])
    assert err.value.status() == "StatusCode.UNAUTHENTICATED" and "Bearer" in err.value.message()
    with pytest.raises(InferenceServerException) as err:
        triton.infer("mlp", [x], headers={"authorization": "Bearer wrong"})
    assert err.value.status() == "StatusCode.UNAUTHENTICATED"
    assert triton.infer("mlp", [x], headers=BEARER).as_numpy("y").shape == (1, 10)
    assert triton.is_server_ready(headers=BEARER)
    with grpc.secure_channel(broker.grpc.replace("127.0.0.1", "localhost"),
                             grpc.ssl_channel_credentials(broker.cert)) as channel:   # no token
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING


def test_plaintext_is_refused(broker):
    with grpc.insecure_channel(broker.grpc) as channel:
        with pytest.raises(grpc.RpcError) as err:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_client_shared_memory_is_off_unless_allowed(triton):
    with pytest.raises(InferenceServerException) as err:
        triton.register_system_shared_memory("r", "/tgw-nothing", 64, headers=BEARER)
    assert err.value.status() == "StatusCode.UNIMPLEMENTED" and \
        err.value.message().startswith("Client shared memory is disabled.") and "allow_client_shm" in err.value.message()
    assert "system_shared_memory" not in triton.get_server_metadata(headers=BEARER).extensions
