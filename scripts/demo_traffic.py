"""Demo traffic: real requests to every demo model, each answer checked against the model run
in-process; prints requests, errors, mismatches, p50/p99 latency and requests/s per model, over
the native socket (a Client shared by threads, and one AsyncClient with ASYNC_INFLIGHT requests
in flight) and over the KServe v2 HTTP face; the same for the two pipelines, classify and
embed-text (demo_pipelines.py), and a corrupt image among good ones; the generator tiny-gpt
streaming over the native client, sync and async, each sequence checked against the model's
greedy run in-process (demo_generate.py); then a hot swap of mlp
under traffic (no request may fail), and the request counters /metrics shows.

Exits non-zero on any error or mismatch. Used by scripts/demo.sh.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import numpy as np

import demo_faces
import demo_generate
import demo_http
import demo_pipelines
from demo_load import CONCURRENCY, closed_loop
from tgw.client import Client, ConnectError, TgwError
ASYNC_INFLIGHT = 32


def wait_ready(address: str, broker_pid: int | None, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if broker_pid and not os.path.exists(f"/proc/{broker_pid}"):
            sys.exit("broker exited during start-up")
        try:
            with Client(address, connect_timeout=1.0) as c:
                if c.health()["ready"]:
                    return
        except ConnectError:
            pass
        time.sleep(0.2)
    sys.exit(f"broker at {address} not ready after {timeout:.0f}s")


def make_inputs(model: dict, rng: np.random.Generator) -> dict:
    rows = int(rng.integers(1, 5))
    length = int(rng.integers(1, 40))  # one length per request for variable dims
    out = {}
    for t in model["inputs"]:
        shape = [rows, *(length if d == -1 else d for d in t["shape"])]
        if t["dtype"].startswith("float"):
            out[t["name"]] = rng.standard_normal(shape).astype(t["dtype"])
        else:
            out[t["name"]] = rng.integers(0, 1000, shape).astype(t["dtype"])
    return out


def drive(address: str, model: dict, n: int, http: str | None = None) -> tuple[list, list, list, float]:
    """n requests from CONCURRENCY threads sharing one Client (or over HTTP at `http`); returns
    (records, latencies, errors, seconds)."""
    def call(c: Client, rng: np.random.Generator) -> tuple:
        x = make_inputs(model, rng)
        return x, demo_http.infer(http, model, x) if http else c.infer(model["name"], x, timeout=30)

    return closed_loop(address, n, call)


def drive_async(address: str, model: dict, n: int) -> tuple[list, list, list, float]:
    """As drive, from ASYNC_INFLIGHT coroutines sharing one AsyncClient (one socket, one thread)."""
    import asyncio

    from tgw.client import AsyncClient
    records, latencies, errors = [], [], []

    async def main() -> float:
        counter = iter(range(n))
        async with AsyncClient(address) as c:
            async def caller(seed: int) -> None:
                rng = np.random.default_rng(seed)
                for _ in counter:
                    x = make_inputs(model, rng)
                    t0 = time.perf_counter()
                    try:
                        y = await c.infer(model["name"], x, timeout=30)
                    except TgwError as err:
                        errors.append(err.code.value)
                        continue
                    latencies.append(time.perf_counter() - t0)
                    records.append((x, y))
            t0 = time.perf_counter()
            await asyncio.gather(*(caller(s) for s in range(ASYNC_INFLIGHT)))
            return time.perf_counter() - t0
    elapsed = asyncio.run(main())
    return records, latencies, errors, elapsed


def demo_path(models_dir: str, name: str) -> tuple[str, str]:
    """(file, format) of demo model `name` (mlp-export: mlp's weights as a torch.export program)."""
    from tgw.workers.demo_models import FORMAT_MODELS, demo_file  # imports torch: after the timed traffic
    base, fmt = FORMAT_MODELS.get(name, (name, "torchscript"))
    return demo_file(models_dir, base, fmt), fmt


def mismatches(records: list, models_dir: str, model: dict) -> int:
    import torch  # only for the in-process reference, after the timed traffic
    from tgw.workers.formats import load_in_process
    path, fmt = demo_path(models_dir, model["name"])
    module = load_in_process(fmt, path).call   # the program as the worker loads it, in this process
    bad = 0
    with torch.inference_mode():
        for x, y in records:
            ref = module(*[torch.from_numpy(x[t["name"]]) for t in model["inputs"]])
            if isinstance(ref, torch.Tensor):
                ref = [ref]
            if isinstance(ref, dict):
                ref = [ref[o["name"]] for o in model["outputs"]]
            for o, r in zip(model["outputs"], ref):
                if not np.allclose(y[o["name"]], r.numpy(), rtol=1e-4, atol=1e-5):
                    bad += 1
                    break
    return bad


def hot_swap(address: str, model: dict, models_dir: str, n: int) -> tuple[int, int, int, float, str]:
    """Drive `model` while `tgw-broker models load` swaps in version "2" (the same file, so the
    answers stay checkable); returns (requests, errors, mismatches, swap ms, the broker's message)."""
    from tgw.broker.cli.ask import ask
    from tgw.shm.wire import PROTOCOL_VERSION, LoadVersion

    result: list = []
    driver = threading.Thread(target=lambda: result.append(drive(address, model, n)))
    with Client(address) as c:
        before = c.stats()["models"][model["name"]]["requests"]
        driver.start()
        while c.stats()["models"][model["name"]]["requests"] < before + n // 4 and driver.is_alive():
            time.sleep(0.01)   # swap once traffic flows
    t0 = time.perf_counter()
    path = demo_path(models_dir, model["name"])[0]
    reply = ask(address, LoadVersion(v=PROTOCOL_VERSION, model=model["name"], version="2", path=path), 120)
    swap_ms = (time.perf_counter() - t0) * 1e3
    driver.join()
    records, lat, errors, _ = result[0]
    return len(lat) + len(errors), len(errors), mismatches(records, models_dir, model), swap_ms, reply.message


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", required=True)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--models-dir", required=True)
    ap.add_argument("--broker-pid", type=int)
    args = ap.parse_args()
    wait_ready(args.address, args.broker_pid)
    with Client(args.address) as c:
        served = c.models()
        status = c.status()
        http, grpc = status["http"], status["grpc"]
    # the pipelines and the stages they run are driven by demo_pipelines: images and text, not random
    # tensors; the generator by demo_generate and demo_faces: it streams; the sequence models by
    # demo_faces: their requests carry a sequence id
    models = [m for m in served
              if m["name"] not in (*demo_pipelines.PIPELINES, *demo_pipelines.STAGES, demo_generate.MODEL,
                                   *demo_faces.SEQUENCE_MODELS)]
    rows, failed = [], False
    for face, url in (("native", None), ("async", None), ("HTTP", http)):
        for model in models:
            if face == "async":
                records, lat, errors, elapsed = drive_async(args.address, model, args.requests)
            else:
                records, lat, errors, elapsed = drive(args.address, model, args.requests, url)
            bad = mismatches(records, args.models_dir, model)
            ms = np.array(lat) * 1e3 if lat else np.array([np.nan])
            rows.append((model["name"], face, len(lat) + len(errors), len(errors), bad, np.percentile(ms, 50),
                         np.percentile(ms, 99), len(lat) / elapsed))
            failed |= bool(errors) or bad > 0 or len(lat) != args.requests
    pipeline_rows, pipelines_failed = demo_pipelines.run(args.address, http, args.models_dir, args.requests)
    rows += pipeline_rows
    failed |= pipelines_failed
    print(f"\n{'model':<10} {'face':<7} {'requests':>8} {'errors':>6} {'mismatches':>10} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'req/s':>8}")
    for name, face, n, e, bad, p50, p99, rps in rows:
        print(f"{name:<10.10} {face:<7} {n:>8} {e:>6} {bad:>10} {p50:>8.2f} {p99:>8.2f} {rps:>8.0f}")
    print(f"(concurrency {CONCURRENCY} threads; async: one AsyncClient, {ASYNC_INFLIGHT} in flight; 1-4 rows per "
          f"request, answers checked against the model run in-process; HTTP: KServe v2 at {http}, binary tensors;\n"
          f" pipelines: 1-4 images or texts per request, checked against the same stages and models run in-process, "
          f"labels equal, scores and embeddings within {demo_pipelines.TOLERANCE:g}; embed-text over HTTP as JSON)")
    failed |= not demo_pipelines.show_burst(args.address, args.models_dir)
    generate_rows, generate_failed = demo_generate.run(args.address, args.models_dir)
    demo_generate.show(generate_rows)
    failed |= generate_failed
    if grpc:
        face_rows, faces_failed = demo_faces.generate_on_faces(http, grpc, args.models_dir)
        demo_generate.show(face_rows)
        _, sequences_failed = demo_faces.sequences_on_faces(args.address, http, grpc)
        failed |= faces_failed or sequences_failed
    else:
        print("\nthe gRPC face is off (start with --grpc-port): tiny-gpt's streams over gRPC, HTTP and openai skipped")
    if not any(m["name"] == "mlp-aoti" for m in models):
        print("mlp-aoti: not served, no C++ compiler was found to build its AOTInductor package (the broker log "
              "says so); install g++ and start again to add it")
    mlp = next(m for m in models if m["name"] == "mlp")
    n, e, bad, swap_ms, message = hot_swap(args.address, mlp, args.models_dir, 4 * args.requests)
    print(f"\nhot swap of mlp 1 -> 2 under traffic: {n} requests, {e} errors, {bad} mismatches; the swap "
          f"(load beside, flip, drain, unload) took {swap_ms:.0f} ms\n  broker: {message}")
    failed |= bool(e) or bad > 0 or n != 4 * args.requests
    print(f"\n{http}/metrics, requests by model, version and outcome:")
    for line in demo_http.metrics_lines(http):
        print(f"  {line}")
    print("RESULT:", "FAIL" if failed else "OK")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
