"""The in-process floor of a TorchServe archive: what its handler costs with no server at all -
the archive unpacked, loaded by the `ts` package's own TsModelLoader (as TorchServe's Python
worker loads it) and `Service.predict` called in a loop on batches of the same request, in a
fresh interpreter with one torch thread. CPU µs per request and requests/s of that loop: no
server running the same handler can spend less per request, so TorchServe's server CPU per
request over this floor bounds what any server can gain on a CPU-bound box.

    python -m tgw.bench.harness.ts_floor ARCHIVE.mar BODY_FILE CONTENT_TYPE BATCH SECONDS   # prints JSON
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from typing import Any


def floor(mar: str, body_path: str, content_type: str, batch: int, seconds: float) -> dict[str, Any]:
    """Run in this process (main() sets the threads first): the loop's figures."""
    import ts
    import torch
    from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl
    from ts.model_loader import TsModelLoader
    torch.set_num_threads(1)
    folder = tempfile.mkdtemp(prefix="tsfloor-")
    with zipfile.ZipFile(mar) as z:
        z.extractall(folder)
    with open(os.path.join(folder, "MAR-INF", "MANIFEST.json")) as f:
        model = json.load(f)["model"]
    metrics = MetricsCacheYamlImpl(os.path.join(os.path.dirname(ts.__file__), "configs", "metrics.yaml"))
    metrics.initialize_cache()
    sys.path.insert(0, folder)
    os.chdir(folder)   # as TorchServe's worker runs in the model's folder
    service = TsModelLoader().load(model["modelName"], folder, model["handler"], None, batch, None, True, metrics)
    service.set_cl_socket(None)
    with open(body_path, "rb") as f:
        body = f.read()
    # a request as TorchServe's worker decodes its frame: text bodies as str, others as bytearray
    value = body.decode() if content_type.startswith("text") else bytearray(body)
    requests = [{"requestId": str(i).encode(), "parameters": [{"name": "body", "contentType": content_type,
                                                               "value": value}], "headers": []} for i in range(batch)]
    for _ in range(20):   # warm-up
        service.predict(requests)
    n, c0, t0 = 0, time.process_time(), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        service.predict(requests)
        n += batch
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"requests": n, "batch": batch, "requests_per_s": n / wall, "cpu_us_per_request": 1e6 * cpu / n,
            "wall_us_per_request": 1e6 * wall / n}


def run_floor(mar: str, body_path: str, content_type: str, batch: int, seconds: float) -> dict[str, Any]:
    """floor() in a fresh interpreter with one torch thread; its JSON."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", __name__, mar, body_path, content_type, str(batch), str(seconds)],
                          capture_output=True, text=True, env=env, timeout=300 + seconds)
    if proc.returncode != 0:
        raise RuntimeError(f"the in-process floor failed ({proc.returncode}): {proc.stderr.strip()[-1500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    mar, body_path, content_type, batch, seconds = argv
    print(json.dumps(floor(mar, body_path, content_type, int(batch), float(seconds))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
