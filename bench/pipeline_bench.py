"""`tgw-bench pipeline`: the demo's `classify` pipeline (JPEG -> decode -> resnet -> top-5) against
(a) the same steps in one process, batched (the floor), (b) Flask + gunicorn doing decode + model +
top-5 per request, (c) tgw with the caller decoding and sending tensors to `resnet`; the broker's
CPU per request and per added step hop; and stage concurrency: a 5 ms pre-processing stage
before a 5 ms model, one stage worker and one model worker, against the 10 ms serial sum.

    tgw-bench pipeline [--quick] [--concurrency 16,64] [--duration S] [--json FILE] [--no-results-md]

Closed loop, one image per request; results JSON under bench/results/ (with the command and the
machine's load) and a section of bench/RESULTS.md; docs/BENCHMARKS.md "Pipelines" says what each row measures.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Callable, Iterator

from tgw.bench.loadgen import LoadSpec
from tgw.bench.measure import loadgen_drive, measure, stats_diff
from tgw.bench.pipeline_parts import CallerDecodesTarget, ClassifyFlask, PipelineTarget, images_of, run_floor
from tgw.bench.targets import HttpTarget
from tgw.broker.child import BrokerProc

MODES = {"quick": {"duration": 3.0, "warmup": 1.0, "floor_seconds": 1.0},
         "full": {"duration": 8.0, "warmup": 2.0, "floor_seconds": 3.0}}
GOALS = {"pipeline_over_flask": 1.5, "pipeline_over_caller_decodes": 1.0, "broker_us_per_hop": 40.0,
         "concurrency_over_serial": 1.6}
STAGE_MS = MODEL_MS = 5.0


def add_parser(sub) -> None:
    p = sub.add_parser("pipeline", help="the classify pipeline against in-process, Flask and caller-decodes; "
                                        "stage concurrency")
    p.add_argument("--quick", action="store_true", help="short phases (about a minute in all)")
    p.add_argument("--concurrency", default="16,64", help="closed-loop levels for classify (default 16,64)")
    p.add_argument("--duration", type=float, help="override: measured seconds per row")
    p.add_argument("--workers", type=int, default=1, help="tgw cpu model workers (default 1; plus 1 stage worker)")
    p.add_argument("--threads", type=int, default=1, help="workers.threads_per_worker of the tgw brokers (default 1)")
    p.add_argument("--flask-workers", type=int, default=os.cpu_count() or 1, help="gunicorn workers (default: cores)")
    p.add_argument("--json", help="result file (default bench/results/pipeline-<time>.json)")
    p.add_argument("--no-results-md", action="store_true", help="do not touch bench/RESULTS.md")
    p.add_argument("--procs", type=int, default=0, help="generator processes (default: half the cores, 2..4)")


def build(work: str) -> dict:
    """The demo's models, stages and data in `work` (a subprocess: torch stays out of this one)."""
    out = subprocess.run([sys.executable, "-m", "tgw.workers.demo_models", work, "--stages"], capture_output=True,
                         text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"building the demo failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout)


def entry(name: str, d: dict, max_batch_size: int | None = None) -> dict:
    version = {"version": "1", **({"handler": d["handler"]} if "handler" in d else {"path": d["path"]})}
    extra = {"device": "cpu", "options": d.get("options", {})} if "handler" in d else {}
    return {"name": name, "versions": [version], "inputs": d["inputs"], "outputs": d["outputs"],
            "max_batch_size": max_batch_size or d["max_batch_size"], **extra}


def broker_config(models: list[dict], pipelines: list[dict], workers: int, threads: int = 1) -> dict:
    return {"workers": {"devices": ["cpu"] * workers, "threads_per_worker": threads, "stage_workers": 1},
            "models": models, "pipelines": pipelines}


CLASSIFY = {"name": "classify", "inputs": ["image"],
            "steps": [{"name": "decode", "model": "decode-image", "inputs": {"image": "image"}},
                      {"name": "infer", "model": "resnet", "inputs": {"image": "decode.pixels"}},
                      {"name": "top5", "model": "top5", "inputs": {"logits": "infer.logits"}}],
            "outputs": {"labels": "top5.labels", "scores": "top5.scores"}}
SLEEP_SPIN = {"name": "sleep-spin", "inputs": ["x"],
              "steps": [{"name": "pre", "model": "sleep", "inputs": {"x": "x"}},
                        {"name": "model", "model": "spin", "inputs": {"x": "pre.x"}}],
              "outputs": {"y": "model.y"}}


@contextlib.contextmanager
def broker(config: dict, work: str, name: str) -> Iterator[BrokerProc]:
    folder = tempfile.mkdtemp(prefix=f"{name}-", dir=work)
    b = BrokerProc(config, folder).start(timeout=180)
    try:
        yield b
    finally:
        b.stop()


def tgw_row(b: BrokerProc, target: Any, spec: LoadSpec, models: tuple[str, ...]) -> dict:
    """One measured level against broker `b`; broker_stats per model in `models`."""
    from tgw.client import Client
    with Client(b.address) as c:
        snaps: list = []

        def stats() -> dict:
            snaps.append(c.stats())
            return snaps[-1]
        row = measure(target, spec, c.stats()["processes"], stats=stats)
    row["stats_by_model"] = {m: stats_diff(snaps[0], snaps[-1], m) for m in models}
    return row


def brief(row: dict) -> dict:
    """What the tables and the ratios use of a measured row."""
    us = row.get("cpu_us_per_request") or {}
    return {"throughput_rps": round(row["throughput_rps"], 1), "p50_ms": row["latency_ms"].get("p50"),
            "p99_ms": row["latency_ms"].get("p99"), "failed": row.get("requests_failed", 0),
            "broker_us_per_request": us.get("broker"), "other_cpu_cores": (row.get("machine") or {}).get("other_cpu_cores")}


def classify_rows(work: str, built: dict, levels: list[int], mode: dict, a, log: Callable[[str], None]) -> dict:
    labels = built["top5"]["options"]["labels"]
    floor = run_floor(work, mode["floor_seconds"], os.cpu_count() or 1)
    log(f"(a) in-process floor: {floor['throughput_rps']:.0f} images/s (batch {floor['best_batch']})")
    body = os.path.join(work, "image.jpg")
    with open(body, "wb") as f:
        f.write(images_of(work)[4])
    out: dict[str, Any] = {"floor": floor, "levels": {}}
    spec = lambda c: LoadSpec("closed", c, mode["duration"], mode["warmup"], a.procs)  # noqa: E731
    flask = ClassifyFlask(built["resnet"]["path"], labels, a.flask_workers, work)
    try:
        for c in levels:
            target = HttpTarget("127.0.0.1", flask.port, "/classify", body, label="flask", content_type="image/jpeg")
            row = measure(target, spec(c), flask.processes, drive=lambda *x, **k: loadgen_drive(*x, "python-fallback", **k))
            out["levels"].setdefault(str(c), {})["flask"] = {**brief(row), "raw": row}
            log(f"(b) flask c={c}: {row['throughput_rps']:.0f} req/s")
    finally:
        flask.stop()
    models = [entry(n, built[n]) for n in ("decode-image", "resnet", "top5")]
    with broker(broker_config(models, [CLASSIFY], a.workers, a.threads), work, "classify") as b:
        for c in levels:
            for key, target in (("pipeline", PipelineTarget(b.address, work)),
                                ("caller_decodes", CallerDecodesTarget(b.address, work))):
                row = tgw_row(b, target, spec(c), ("classify", "decode-image", "resnet", "top5"))
                out["levels"][str(c)][key] = {**brief(row), "raw": row}
                log(f"({'c' if key == 'caller_decodes' else 'tgw'}) {key} c={c}: {row['throughput_rps']:.0f} req/s, "
                    f"broker {brief(row)['broker_us_per_request']} us/request")
    for c, rows in out["levels"].items():
        p, f, d = (rows[k] for k in ("pipeline", "flask", "caller_decodes"))
        hop = None if None in (p["broker_us_per_request"], d["broker_us_per_request"]) else \
            (p["broker_us_per_request"] - d["broker_us_per_request"]) / 2   # 3 steps against 1: 2 hops more
        rows["ratios"] = {"pipeline_over_floor": p["throughput_rps"] / floor["throughput_rps"],
                          "pipeline_over_flask": p["throughput_rps"] / f["throughput_rps"],
                          "pipeline_over_caller_decodes": p["throughput_rps"] / d["throughput_rps"],
                          "broker_us_per_added_hop": hop}
    return out


def concurrency_row(work: str, built: dict, mode: dict, a, log: Callable[[str], None]) -> dict:
    spin = json.loads(subprocess.run([sys.executable, "-m", "tgw.bench.pipeline_parts", "spin",
                                      os.path.join(work, "spin.pt"), str(MODEL_MS)], capture_output=True, text=True,
                                     check=True, timeout=300).stdout)
    x = [{"name": "x", "dtype": "float32", "shape": [4]}]
    models = [{"name": "sleep", "versions": [{"version": "1", "handler": "tgw.workers.demo_stages:Sleep"}],
               "device": "cpu", "options": {"ms": STAGE_MS}, "inputs": x, "outputs": x, "max_batch_size": 1},
              {"name": "spin", "versions": [{"version": "1", "path": spin["path"]}], "inputs": x,
               "outputs": [{"name": "y", "dtype": "float32", "shape": [4]}], "max_batch_size": 1}]
    from tgw.bench.targets import TgwTarget
    with broker(broker_config(models, [SLEEP_SPIN], 1), work, "concurrency") as b:
        row = tgw_row(b, TgwTarget(b.address, "sleep-spin", label="sleep-spin"),
                      LoadSpec("closed", 16, mode["duration"], mode["warmup"], a.procs), ("sleep", "spin"))
    per_batch_ms = {m: (s["compute_us"] / s["batches"] / 1e3 if s["batches"] else None)
                    for m, s in row["stats_by_model"].items()}
    # the serial sum of what the two steps measured per batch in this run (else the nominal 10 ms)
    measured = None if None in per_batch_ms.values() else sum(per_batch_ms.values())
    serial_rps = 1e3 / (measured or STAGE_MS + MODEL_MS)
    out = {**brief(row), "spin_model": spin, "compute_ms_per_batch": per_batch_ms, "serial_sum_rps": serial_rps,
           "over_serial": row["throughput_rps"] / serial_rps, "raw": row}
    log(f"stage concurrency: {row['throughput_rps']:.0f} req/s = {out['over_serial']:.2f}x the {serial_rps:.0f} req/s "
        f"the serial sum allows (compute per batch: {per_batch_ms})")
    return out


def run(a: argparse.Namespace, command: str) -> int:
    mode = dict(MODES["quick" if a.quick else "full"])
    if a.duration:
        mode["duration"] = a.duration
    levels = [int(x) for x in a.concurrency.split(",") if x]
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="tgwpb-", dir="/tmp") as work:   # ipc paths stay short
        built = build(work)
        result = {"command": command, "date": datetime.datetime.now().isoformat(timespec="seconds"),
                  "cores": os.cpu_count(), "load_avg_1m_before": load0[0], "mode": mode, "goals": GOALS,
                  "classify": classify_rows(work, built, levels, mode, a, print),
                  "stage_concurrency": concurrency_row(work, built, mode, a, print)}
    result["load_avg_1m_after"] = os.getloadavg()[0]
    from tgw.bench.pipeline_report import summary_lines, write_results
    path = write_results(result, a.json, not a.no_results_md)
    print("\n".join(summary_lines(result)))
    print(f"wrote {path}")
    failed = sum(r["failed"] for lv in result["classify"]["levels"].values() for k, r in lv.items() if k != "ratios")
    return 1 if failed or result["stage_concurrency"]["failed"] else 0
