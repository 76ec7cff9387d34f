"""`tgw-bench triton-ensemble`: a Triton repository with an ensemble of Python-backend pre- and
post-processing around a `pytorch_libtorch` model (tgw.testing.triton_repo: `ensemble_classify`
= `preprocess` -> `classifier` -> `postprocess`, a 16x16 RGB image in, its top label and
probability out), served as it is by tgw (`tgw-broker start --model-repository`), against
PyTriton serving the same Python code (the model.py files' `preprocess` and `postprocess`
functions around the same TorchScript file, one function bound with @batch;
bench/harness/pytriton_serve.py). Both driven over KServe v2 HTTP with the binary tensor
extension by the same load generator, closed loop at c=16 (the issue's goal: tgw's req/s >=
PyTriton's), in rounds that alternate the two servers: each row's best round, and the median of
the rounds' ratios. Each server's answers are checked against an in-process run of the same code
before its window.

PyTriton runs from its own Python environment (`--pytriton-python`, default
$TGW_PYTRITON_PYTHON or /tmp/pytriton-venv/bin/python: `python -m venv /tmp/pytriton-venv &&
/tmp/pytriton-venv/bin/pip install nvidia-pytriton==0.7.0 torch==2.13.0`; its wheel bundles a
tritonserver binary). Where it cannot start, the result file records why and the exit status is 1.
Writes bench/results/triton-ensemble-<date>[-quick].json; exit status 0 when both rows ran with
every request answered and every check right, 1 otherwise.

    tgw-bench triton-ensemble --quick      # one round of 2 s: seconds, for the test
    tgw-bench triton-ensemble              # the full run bench/results/triton-ensemble-*.json holds
"""
from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

import numpy as np

from tgw.bench.harness import report
from tgw.bench.harness.haproxy import free_port
from tgw.bench.harness.loadgen import LoadSpec
from tgw.bench.harness.measure import measure
from tgw.bench.harness.targets import v2_body, v2_target
from tgw.testing import triton_repo
from tgw.testing.child import BrokerProc, Proc, exit_record, finish_run

NAME = "triton-ensemble"
HELP = "a Triton repository's Python pre/post + libtorch ensemble: tgw's req/s at c=16 against PyTriton's"
MODEL = "ensemble_classify"
TARGET = 1.0
SERVE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "harness", "pytriton_serve.py")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="one round of 2 s per server (seconds)")
    p.add_argument("--concurrency", type=int, default=16, help="closed-loop callers (default 16)")
    p.add_argument("--duration", type=float, default=None, help="seconds per window (default 10, quick 2)")
    p.add_argument("--rounds", type=int, default=None, help="rounds of both rows, each row's best kept (default 3, "
                                                             "quick 1)")
    p.add_argument("--pytriton-python", default=os.environ.get("TGW_PYTRITON_PYTHON", "/tmp/pytriton-venv/bin/python"),
                   help="the Python of an environment with nvidia-pytriton and torch (default $TGW_PYTRITON_PYTHON "
                        "or /tmp/pytriton-venv/bin/python)")
    p.add_argument("--stage-workers", type=int, default=0,
                   help="tgw workers that serve only the Python models (default 0: they share the CPU worker, as PyTriton runs the whole chain in one process)")
    p.add_argument("--out", help="folder for results/ (default: bench/ of the checkout, else .)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder (repository, logs, sockets)")


def reference(repo: str, images: np.ndarray) -> tuple[list[bytes], np.ndarray]:
    """The ensemble's answers computed in this process with the repository's own code."""
    import importlib.util
    import types

    import torch
    sys.modules.setdefault("triton_python_backend_utils", types.ModuleType("triton_python_backend_utils"))
    mods = []
    for step in ("preprocess", "postprocess"):
        spec = importlib.util.spec_from_file_location(f"bench_{step}", os.path.join(repo, step, "1", "model.py"))
        mods.append(importlib.util.module_from_spec(spec))
        spec.loader.exec_module(mods[-1])
    net = torch.jit.load(os.path.join(repo, "classifier", "1", "model.pt"))
    with torch.inference_mode():
        scores = net(torch.from_numpy(mods[0].preprocess(images))).numpy()
    labels, probs = mods[1].postprocess(scores)
    return [x for x in labels.ravel()], probs.ravel()


def check(url: str, images: np.ndarray, want: tuple[list[bytes], np.ndarray]) -> None:
    """One request per image with tritonclient: each answer must be the in-process one."""
    import tritonclient.http as httpclient
    c = httpclient.InferenceServerClient(url.removeprefix("http://"))
    try:
        for k, row in enumerate(images):
            x = httpclient.InferInput("IMAGE", [1, row.size], "UINT8")
            x.set_data_from_numpy(row.reshape(1, -1))
            r = c.infer(MODEL, [x])
            label, prob = r.as_numpy("LABEL").ravel()[0], float(r.as_numpy("PROBABILITY").ravel()[0])
            if label != want[0][k] or abs(prob - float(want[1][k])) > 1e-4:
                raise AssertionError(f"{url}: image {k} answered {label!r} {prob:.5f}, expected "
                                     f"{want[0][k]!r} {float(want[1][k]):.5f}")
    finally:
        c.close()


def start_pytriton(python: str, repo: str, work: str) -> tuple[Proc, str]:
    """PyTriton serving the ensemble's code in its own environment; (its Proc, its HTTP url)."""
    if not os.path.isfile(python):
        raise RuntimeError(f"no PyTriton environment at {python} (see `tgw-bench triton-ensemble --help`)")
    ports = [free_port() for _ in range(3)]
    # PyTriton's Python-backend stub links the system's libpython3.X; the venv's own libpython
    # goes first, so that the stub's interpreter matches the standard library it imports
    libdir = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"],
                            capture_output=True, text=True, check=True).stdout.strip()
    env = {**os.environ, "LD_LIBRARY_PATH": ":".join(filter(None, [libdir, os.environ.get("LD_LIBRARY_PATH")]))}
    proc = Proc([python, SERVE, repo, *map(str, ports), MODEL], os.path.join(work, "pytriton.log"), "pytriton")
    proc.start(env)
    proc.wait_for(lambda: "READY" in proc.output(), 180, "PyTriton's READY")
    return proc, f"http://127.0.0.1:{ports[0]}"


def pytriton_processes(proc: Proc) -> list[dict[str, Any]]:
    """PyTriton's processes for the CPU accounting: its Python process and tritonserver (with the stubs)."""
    import psutil
    out = [{"role": "pytriton-python", "pid": proc.pid}]
    for child in psutil.Process(proc.pid).children(recursive=True):
        out.append({"role": child.name(), "pid": child.pid})
    return out


def _f(v: Optional[float], fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def run(a: argparse.Namespace) -> int:
    duration = a.duration or (2.0 if a.quick else 10.0)
    rounds = a.rounds or (1 if a.quick else 3)
    if a.concurrency < 1 or rounds < 1 or duration <= 0:
        print("--concurrency and --rounds must be at least 1, --duration above 0", file=sys.stderr)
        return 2
    log = lambda msg: print(f"[triton-ensemble {time.strftime('%H:%M:%S')}] {msg}", flush=True)  # noqa: E731
    mode = "custom" if (a.duration, a.rounds, a.concurrency, a.stage_workers) != (None, None, 16, 0) else ("quick" if a.quick else "full")
    work = tempfile.mkdtemp(prefix="tgwte-", dir="/tmp")
    t0, date = time.monotonic(), datetime.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    res: dict[str, Any] = {"scenario": NAME, "mode": mode, "date": date, "command": a.command_line,
                           "machine": report.machine(), "rows": {"tgw": {}, "pytriton": {}}}
    broker = pyt = None
    try:
        repo = os.path.join(work, "repo")
        triton_repo.write(repo, only=triton_repo.ENSEMBLE_MODELS)
        body_path = os.path.join(work, "body.bin")
        body, header = v2_body({"inputs": [{"name": "IMAGE", "dtype": "uint8", "shape": [triton_repo.IMAGE_BYTES]}]},
                               binary=True)
        with open(body_path, "wb") as f:
            f.write(body)
        probe = triton_repo.images(8, seed=3)
        want = reference(repo, probe)
        res["settings"] = {
            "repository": "tgw.testing.triton_repo's ensemble_classify: preprocess (python: uint8 HWC -> normalised "
                          "float32 CHW) -> classifier (pytorch_libtorch: a tiny CNN, TorchScript) -> postprocess "
                          "(python: softmax, top-1 label and probability); each max_batch_size 64 with "
                          "dynamic_batching max_queue_delay_microseconds 500",
            "tgw": f"tgw-broker start --model-repository REPO: one CPU worker and {a.stage_workers} stage worker(s), "
                   "one torch thread each",
            "pytriton": "nvidia-pytriton 0.7.0 (its bundled tritonserver): the model.py files' preprocess and "
                        "postprocess functions around the same TorchScript file in one @batch function, "
                        "max_batch_size 64, dynamic batcher 500 us, one torch thread",
            "load": f"KServe v2 HTTP POST /v2/models/{MODEL}/infer, binary tensor extension, one image a request, "
                    f"closed loop c={a.concurrency}, {duration:g} s windows after 1 s warm-up, {rounds} rounds "
                    "alternating the servers",
            "check": "8 images through tritonclient.http on each server before its windows: label and probability "
                     "equal to an in-process run of the same code"}
        cfg = {"http": {"port": 0},
               "workers": {"devices": ["cpu"], "threads_per_worker": 1, "stage_workers": a.stage_workers}}
        broker = BrokerProc(cfg, work).start(args=("--model-repository", repo), timeout=300)
        from tgw.client import Client
        with Client(broker.address) as c:
            tgw_url, tgw_procs = c.status()["http"], c.stats()["processes"]
        check(tgw_url, probe, want)
        log(f"tgw serves {MODEL} at {tgw_url}; answers checked")
        try:
            pyt, pyt_url = start_pytriton(a.pytriton_python, repo, work)
            check(pyt_url, probe, want)
            log(f"PyTriton serves {MODEL} at {pyt_url}; answers checked")
        except Exception as exc:  # noqa: BLE001 - recorded: the baseline could not run here
            res["pytriton_error"] = f"{type(exc).__name__}: {exc}" + (f"\n{pyt.output()[-2000:]}" if pyt else "")
            log(f"PyTriton could not run: {res['pytriton_error']}")
        spec = LoadSpec(mode="closed", level=a.concurrency, duration=duration, warmup=1.0)
        targets = {"tgw": (v2_target(tgw_url, MODEL, body_path, header, True, label="tgw"), tgw_procs)}
        if pyt is not None:
            targets["pytriton"] = (v2_target(pyt_url, MODEL, body_path, header, True, label="pytriton"),
                                   pytriton_processes(pyt))
        for r in range(rounds):
            for row, (target, procs) in targets.items():
                new = measure(target, spec, procs)
                old = res["rows"][row]
                kept = new if not old or new["throughput_rps"] > old["throughput_rps"] else old
                res["rows"][row] = {**kept, "rounds": old.get("rounds", []) + [new["throughput_rps"]]}
                log(f"round {r + 1} {row}: {new['throughput_rps']:,.0f} req/s, p50 "
                    f"{_f(new['latency_ms'].get('p50'), '.2f')} ms, p99 {_f(new['latency_ms'].get('p99'), '.2f')} ms, "
                    f"{new['requests_failed']} failed")
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every server this run started", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - recorded
        res["error"] = f"{type(exc).__name__}: {exc}"
        log(f"FAILED: {res['error']}")
    finally:
        if broker is not None:
            res["server"] = exit_record(broker)
        if pyt is not None:
            res["pytriton_exit_status"] = pyt.stop(timeout=60)
        finish_run(work, a.keep)
    # per round the two rows run back to back, so each ratio pairs rows the shared box's load met alike
    pairs = [x / y for x, y in zip(res["rows"]["tgw"].get("rounds", []), res["rows"]["pytriton"].get("rounds", []))
             if x and y]
    ratio = float(np.median(pairs)) if pairs else None
    res["ratio_per_round"] = pairs
    res["goals"] = [{"goal": f"req/s at c={a.concurrency}, tgw / PyTriton (median of the rounds' ratios)",
                     "value": ratio, "target": TARGET, "unit": "x", "met": None if ratio is None else ratio >= TARGET}]
    body = [["row", "req/s", "p50 ms", "p99 ms", "failed"]]
    for row, r in res["rows"].items():
        lat = r.get("latency_ms") or {}
        body.append([row, _f(r.get("throughput_rps"), ",.0f"), _f(lat.get("p50"), ".2f"), _f(lat.get("p99"), ".2f"),
                     str(r.get("requests_failed", "-"))])
    g = [["goal", "value", "target", "met"]] + [[x["goal"], _f(x["value"], ".2f"), str(x["target"]),
                                                 {True: "yes", False: "NO", None: "-"}[x["met"]]] for x in res["goals"]]
    report.conclude(res, "triton-ensemble", a.out, date, mode, t0, report.text_table(body) + "\n\n" + report.text_table(g))
    complete = "error" not in res and "pytriton_error" not in res and all(
        r.get("requests_ok") and r.get("requests_failed") == 0 for r in res["rows"].values())
    return 0 if complete else 1
