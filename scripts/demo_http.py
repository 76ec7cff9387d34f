"""The demo's HTTP leg: the same checked traffic through the KServe v2 face (binary tensor
extension, or JSON; BYTES tensors as the binary extension's length-prefixed elements or JSON
strings; plain http.client), and a look at /metrics. Used by scripts/demo_traffic.py."""
from __future__ import annotations

import http.client
import json
import struct
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


def pack_bytes(items: list[bytes]) -> bytes:
    """KServe v2 BYTES in the binary extension: each element's 4-byte little-endian length, then it."""
    return b"".join(struct.pack("<I", len(b)) + b for b in items)


def unpack_bytes(raw: bytes, shape: list[int]) -> np.ndarray:
    items, pos = [], 0
    while pos < len(raw):
        n = struct.unpack_from("<I", raw, pos)[0]
        items.append(raw[pos + 4:pos + 4 + n])
        pos += 4 + n
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out.reshape(shape)


def infer(url: str, model: dict, inputs: dict, binary: bool = True) -> dict:
    """POST one request; the outputs as arrays (BYTES ones as object arrays of bytes). An input
    is an array, or a list of bytes (a BYTES tensor of shape [len]). binary: the binary tensor
    extension both ways; else a JSON body (BYTES elements as strings: UTF-8 text only) and a
    JSON answer."""
    specs, blobs = [], []
    for k, v in inputs.items():
        if isinstance(v, list):   # BYTES
            spec = {"name": k, "shape": [len(v)], "datatype": "BYTES"}
            data = pack_bytes(v) if binary else [b.decode() for b in v]
        else:
            spec = {"name": k, "shape": list(v.shape), "datatype": DATATYPES[v.dtype.name]}
            data = np.ascontiguousarray(v).tobytes() if binary else v.ravel().tolist()
        specs.append({**spec, "parameters": {"binary_data_size": len(data)}} if binary else {**spec, "data": data})
        blobs.append(data)
    head = json.dumps({"inputs": specs, "parameters": {"binary_data_output": binary}}).encode()
    body, headers = (b"".join([head, *blobs]), {"Inference-Header-Content-Length": str(len(head))}) if binary \
        else (head, {"Content-Type": "application/json"})
    conn = connection(url)
    try:
        conn.request("POST", f"/v2/models/{model['name']}/infer", body=body, headers=headers)
        r = conn.getresponse()
        raw = r.read()
    except (OSError, http.client.HTTPException):
        conn.close()   # reconnects on the next request
        raise
    if r.status != 200:
        answer = json.loads(raw)
        raise HttpError(answer.get("code", f"HTTP_{r.status}"), answer["error"])
    n = int(r.headers.get("Inference-Header-Content-Length", len(raw)))
    out, pos = {}, n
    for o in json.loads(raw[:n])["outputs"]:
        if "data" in o:   # a JSON answer
            if o["datatype"] == "BYTES":
                out[o["name"]] = unpack_bytes(pack_bytes([d.encode() for d in o["data"]]), o["shape"])
            else:
                dtype = next(d for d, t in DATATYPES.items() if t == o["datatype"])
                out[o["name"]] = np.array(o["data"], dtype=dtype).reshape(o["shape"])
            continue
        size = o["parameters"]["binary_data_size"]
        if o["datatype"] == "BYTES":
            out[o["name"]] = unpack_bytes(raw[pos:pos + size], o["shape"])
        else:
            dtype = next(d for d, t in DATATYPES.items() if t == o["datatype"])
            out[o["name"]] = np.frombuffer(raw[pos:pos + size], dtype=dtype).reshape(o["shape"])
        pos += size
    return out


def metrics_lines(url: str, prefix: str = "tgw_requests_total{") -> list[str]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        return [line for line in r.read().decode().splitlines() if line.startswith(prefix)]
