"""The dependency rule of docs/ARCHITECTURE.md ("Dependency rule"), checked in fresh interpreters: what
importing each package loads. (The module size budget: tests/unit/test_module_size.py.)"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted(sys.modules)))
"""

TGW = ("tgw.shm", "tgw.client", "tgw.broker", "tgw.workers")
SERVER_ONLY = ("uvloop", "psutil", "pynvml", "yaml", "pydantic", "aiohttp", "prometheus_client", "orjson", "opentelemetry")
GRPC = ("grpc", "grpc_health", "grpc_reflection", "google.protobuf")
PROTOCOL = ["tgw.broker.protocol", "tgw.broker.protocol.door", "tgw.broker.protocol.errors", "tgw.broker.protocol.kserve",
            "tgw.broker.protocol.repository", "tgw.broker.protocol.triton_docs", "tgw.broker.protocol.triton_shm"]

# package -> (modules to import, packages that must not be loaded)
CASES = {
    "shm": (["tgw.shm", "tgw.shm.wire", "tgw.shm.errors", "tgw.shm.ring", "tgw.shm.segment", "tgw.shm.views",
             "tgw.shm.paths", "tgw.shm.model_format"],
            ["tgw.client", "tgw.broker", "tgw.workers", "zmq", "torch", "lz4", "onnx", "onnxruntime", *SERVER_ONLY]),
    "client": (["tgw.client", "tgw.client.client", "tgw.client.tensors"],
               ["tgw.broker", "tgw.workers", "torch", *SERVER_ONLY]),
    "broker": (["tgw.broker", "tgw.broker.core.run", "tgw.broker.cli", "tgw.broker.core.assembly", "tgw.broker.core.lifecycle",
                "tgw.broker.sched.admission", "tgw.broker.fleet.handshake", "tgw.broker.observe.status", "tgw.broker.front.endpoints"],
               ["tgw.client", "tgw.workers", "torch", "onnx", "onnxruntime"]),   # ONNX files told without them
    "workers": (["tgw.workers", "tgw.workers.main"],
                ["tgw.client", "tgw.broker", "onnxruntime"]),   # onnxruntime only once an ONNX model loads
    # face-neutral: no face's framework, and no face (orjson is allowed: a JSON codec)
    "protocol": (PROTOCOL, ["aiohttp", *GRPC, "tgw.broker.faces", "tgw.client", "tgw.workers", "torch"]),
    # the faces stand beside each other: neither loads the other, nor its framework
    "grpc_face": (["tgw.broker.faces.grpc", "tgw.broker.faces.grpc.face", "tgw.broker.faces.grpc.infer",
                   "tgw.broker.faces.grpc.services", "tgw.broker.faces.grpc.status_codes", "tgw.broker.faces.grpc.tensors"],
                  ["tgw.broker.faces.http", "aiohttp", "tgw.client", "tgw.workers", "torch"]),
    "http_face": (["tgw.broker.faces.http", "tgw.broker.faces.http.face", "tgw.broker.faces.http.answers",
                   "tgw.broker.faces.http.repository_routes", "tgw.broker.faces.http.shm_routes"],
                  ["tgw.broker.faces.grpc", *GRPC, "tgw.client", "tgw.workers", "torch"]),
    "openai_face": (["tgw.broker.faces.openai", "tgw.broker.faces.openai.face", "tgw.broker.faces.openai.translate",
                     "tgw.broker.faces.openai.text", "tgw.broker.faces.openai.chat", "tgw.broker.faces.openai.errors"],
                    ["tgw.broker.faces.http", "tgw.broker.faces.grpc", *GRPC, "tgw.client", "tgw.workers", "torch"]),
}


def loaded_modules(modules: list[str], cwd: Path) -> set[str]:
    r = subprocess.run([sys.executable, "-c", PROBE, *modules], capture_output=True, text=True, timeout=120,
                       cwd=cwd)
    assert r.returncode == 0, r.stderr
    return set(json.loads(r.stdout.strip().splitlines()[-1]))


def offenders(loaded: set[str], forbidden: list[str]) -> list[str]:
    return sorted(m for m in loaded if any(m == f or m.startswith(f + ".") for f in forbidden))


@pytest.mark.parametrize("package", list(CASES))
def test_import_layering(package, tmp_path):
    modules, forbidden = CASES[package]
    loaded = loaded_modules(modules, tmp_path)       # outside the repo: only the installed package
    assert set(modules) <= loaded
    assert offenders(loaded, forbidden) == [], f"tgw.{package} loads forbidden modules"
    if package == "shm":
        assert "msgspec" in loaded and "numpy" in loaded
    if package == "workers":
        assert "torch" in loaded                     # workers are the one place torch lives
    if package == "grpc_face":
        assert "grpc" in loaded and "tgw.broker.protocol.kserve" in loaded   # not vacuous
    if package == "http_face":
        assert "aiohttp" in loaded and "tgw.broker.protocol.kserve" in loaded


def test_client_and_broker_together_import_no_torch(tmp_path):
    loaded = loaded_modules(["tgw.client", "tgw.broker", "tgw.broker.core.run"], tmp_path)
    assert offenders(loaded, ["torch", "tgw.workers"]) == []


def test_offenders_helper():
    assert offenders({"torch", "torchvision", "torch.nn", "tgw.brokerx"}, ["torch", "tgw.broker"]) == \
        ["torch", "torch.nn"]


def test_the_shared_helpers_load_no_zmq(tmp_path):
    """tgw.shm.keys (the CURVE key parser the client and the broker's verbs share) and
    tgw.shm.devices import zmq only inside their functions (tests/unit/test_keys.py checks them)."""
    probe = "import json, sys, tgw.shm.keys, tgw.shm.devices; print(json.dumps(sorted(sys.modules)))"
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert not [m for m in json.loads(r.stdout) if m == "zmq" or m.startswith("zmq.")]
