"""The demo's HTTP leg: the same checked traffic through the KServe v2 face (binary tensor
extension, plain urllib), and a look at /metrics. Used by scripts/demo_traffic.py."""
from __future__ import annotations

import http.client
import json
import threading
import urllib.parse
import urllib.request

import numpy as np

DATATYPES = {"float32": "FP32", "float16": "FP16", "float64": "FP64", "int64": "INT64", "int32": "INT32",
             "bool": "BOOL", "uint8": "UINT8", "int8": "INT8", "int16": "INT16"}


class HttpError(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


_local = threading.local()   # one keep-alive connection per thread


def connection(url: str) -> http.client.HTTPConnection:
    conn = getattr(_local, "conn", None)
    if conn is None:
        parts = urllib.parse.urlsplit(url)
        conn = _local.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    return conn


def infer(url: str, model: dict, inputs: dict) -> dict:
    """POST one request with binary inputs and outputs; the outputs as arrays."""
    header = {"inputs": [{"name": k, "shape": list(v.shape), "datatype": DATATYPES[v.dtype.name],
                          "parameters": {"binary_data_size": v.nbytes}} for k, v in inputs.items()],
              "parameters": {"binary_data_output": True}}
    head = json.dumps(header).encode()
    body = b"".join([head, *(np.ascontiguousarray(v).tobytes() for v in inputs.values())])
    conn = connection(url)
    try:
        conn.request("POST", f"/v2/models/{model['name']}/infer", body=body,
                     headers={"Inference-Header-Content-Length": str(len(head))})
        r = conn.getresponse()
        raw = r.read()
    except (OSError, http.client.HTTPException):
        conn.close()   # reconnects on the next request
        raise
    if r.status != 200:
        answer = json.loads(raw)
        raise HttpError(answer.get("code", f"HTTP_{r.status}"), answer["error"])
    n = int(r.headers["Inference-Header-Content-Length"])
    out, pos = {}, n
    for o in json.loads(raw[:n])["outputs"]:
        size = o["parameters"]["binary_data_size"]
        dtype = next(d for d, t in DATATYPES.items() if t == o["datatype"])
        out[o["name"]] = np.frombuffer(raw[pos:pos + size], dtype=dtype).reshape(o["shape"])
        pos += size
    return out


def metrics_lines(url: str, prefix: str = "tgw_requests_total{") -> list[str]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        return [line for line in r.read().decode().splitlines() if line.startswith(prefix)]
