"""Prometheus metrics (broker/observe/metrics*.py): the bucket class, and a real broker scraped with
`tgw-broker metrics` after known traffic - exact counts, no GPU figures on a CPU box, the
dashboard's and docs/OPERATIONS.md's metric names against what a scrape exposes. The GPU families from
heartbeats: tests/unit/test_gpu_metrics.py."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import base_config, wait_until
from prometheus_client.parser import text_string_to_metric_families

from tgw.broker.observe.metrics import READINGS
from tgw.broker.state.stats import Buckets
from tgw.client import Client, TgwError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROWS = [1, 2, 3, 4, 5, 1, 7, 8, 2, 1]          # the mlp requests answered with outputs
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


# ---- pure parts ------------------------------------------------------------------------------

def test_buckets_count_a_value_equal_to_a_bound_in_that_bound():
    b = Buckets((0.1, 1.0, 10.0))
    for v in (0.05, 0.1, 0.5, 1.0, 3.0, 100.0):
        b.observe(v)
    b.observe(2.0, n=3)
    assert b.counts == [2, 2, 4, 1]
    assert b.cumulative() == [(0.1, 2), (1.0, 4), (10.0, 8), (float("inf"), 9)]
    assert b.count == 9 and b.sum == pytest.approx(0.05 + 0.1 + 0.5 + 1.0 + 3.0 + 100.0 + 6.0)


@pytest.mark.parametrize("bounds", [(1.0, 0.5), (1.0, 1.0)])
def test_buckets_refuse_bounds_that_do_not_increase(bounds):
    with pytest.raises(ValueError):
        Buckets(bounds)


# ---- a real broker ---------------------------------------------------------------------------

def scrape(address: str, *flags: str) -> str:
    r = subprocess.run([sys.executable, "-m", "tgw.broker", "metrics", "--address", address, *flags],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout


def parse(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams: dict, sample: str, **labels) -> float:
    family = re.sub(r"_(total|bucket|sum|count)$", "", sample)
    hits = [s.value for s in fams[family if family in fams else sample].samples
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, f"{sample}{labels}: {hits}"
    return hits[0]


def exposable(fams: dict) -> set[str]:
    """Every sample name the families may carry, samples or not (an empty family: no GPU, no tenant)."""
    return {f.name + suffix for f in fams.values() for suffix in SUFFIXES[f.type]}


@pytest.fixture(scope="module")
def scraped(model_files, tmp_path_factory):
    """A broker after known traffic: ROWS answered, a refusal of each kind, one model failure."""
    import shutil
    import tempfile

    from tgw.testing.child import BrokerProc
    cfg = base_config(model_files, "mlp", "fails", mlp={"breaker": {}})
    cfg["tenants"] = {"slow": {"rate": 0.001, "burst": 1}}       # one request, then RATE_LIMITED
    d = tempfile.mkdtemp(prefix="tgwx-", dir="/tmp")
    b = BrokerProc(cfg, d).start()
    try:
        with Client(b.address) as c:
            wait_until(lambda: "tgw_worker_rss_bytes{" in scrape(b.address), what="a heartbeat")
            for rows in ROWS[:-1]:
                c.infer("mlp", {"x": np.ones((rows, 256), np.float32)})
            c.infer("mlp", {"x": np.ones((ROWS[-1], 256), np.float32)}, tenant="slow")
            refusals = [("mlp", {"x": np.ones((1, 256), np.float64)}, {}),      # INVALID_INPUT_DTYPE
                        ("nope", {"x": np.ones((1, 256), np.float32)}, {}),     # MODEL_NOT_FOUND
                        ("mlp", {"x": np.ones((1, 256), np.float32)}, {"tenant": "slow"}),  # RATE_LIMITED
                        ("fails", {"x": -np.ones((1, 2), np.float32)}, {})]     # MODEL_EXECUTION_ERROR, admitted
            codes = []
            for model, inputs, kw in refusals:
                with pytest.raises(TgwError) as info:
                    c.infer(model, inputs, **kw)
                codes.append(info.value.code.value)
            status = c.status()
        assert codes == ["INVALID_INPUT_DTYPE", "MODEL_NOT_FOUND", "RATE_LIMITED", "MODEL_EXECUTION_ERROR"]
        text = scrape(b.address)
        reply = json.loads(scrape(b.address, "--json"))
        yield SimpleNamespace(fams=parse(text), text=text, reply=reply, status=status, address=b.address)
    finally:
        code = b.stop()
        shutil.rmtree(d, ignore_errors=True)
        assert code == 0, b.output()


def test_requests_by_model_version_and_code(scraped):
    fams = scraped.fams
    assert value(fams, "tgw_requests_total", model="mlp", version="1", code="OK") == len(ROWS)
    assert value(fams, "tgw_requests_total", model="mlp", version="", code="INVALID_INPUT_DTYPE") == 1
    assert value(fams, "tgw_requests_total", model="mlp", version="", code="RATE_LIMITED") == 1
    assert value(fams, "tgw_requests_total", model="", version="", code="MODEL_NOT_FOUND") == 1
    # admitted, then failed: counted once, under its version
    assert value(fams, "tgw_requests_total", model="fails", version="1", code="MODEL_EXECUTION_ERROR") == 1
    assert sum(s.value for s in fams["tgw_requests"].samples) == len(ROWS) + 4


def test_latency_and_batch_histograms(scraped):
    fams = scraped.fams
    assert value(fams, "tgw_request_duration_seconds_count", model="mlp") == len(ROWS)
    assert value(fams, "tgw_request_duration_seconds_bucket", model="mlp", le="+Inf") == len(ROWS)
    assert value(fams, "tgw_request_queue_seconds_count", model="mlp") == len(ROWS)
    assert value(fams, "tgw_batch_size_rows_sum", model="mlp") == sum(ROWS)
    batches = value(fams, "tgw_batch_size_rows_count", model="mlp")
    assert batches == len(ROWS)            # one caller, one request at a time: a batch each
    assert value(fams, "tgw_batch_size_rows_bucket", model="mlp", le="1.0") == ROWS.count(1)
    assert value(fams, "tgw_batch_compute_seconds_count", model="mlp") == batches
    assert value(fams, "tgw_batch_compute_seconds_sum", model="mlp") > 0


def test_state_at_rest(scraped):
    fams = scraped.fams
    assert value(fams, "tgw_queue_depth", model="mlp", priority="0") == 0
    assert value(fams, "tgw_inflight_requests", model="mlp", version="1") == 0
    assert value(fams, "tgw_worker_rss_bytes", worker="worker0[cpu]", device="cpu") > 0
    assert value(fams, "tgw_worker_state", worker="worker0[cpu]", state="ready") == 1
    assert value(fams, "tgw_worker_state", worker="worker0[cpu]", state="dead") == 0
    assert value(fams, "tgw_worker_restarts_total", worker="worker0[cpu]") == 0
    assert value(fams, "tgw_ring_capacity_bytes", worker="worker0[cpu]", arena="input") == 8 << 20
    assert value(fams, "tgw_ring_used_bytes", worker="worker0[cpu]", arena="input") == 0
    # the last heartbeat's figure: blocks whose release rides on the next batch may still count
    assert 0 <= value(fams, "tgw_ring_used_bytes", worker="worker0[cpu]", arena="output") <= \
        value(fams, "tgw_ring_capacity_bytes", worker="worker0[cpu]", arena="output")
    assert value(fams, "tgw_broker_phase", phase="serving") == 1
    assert value(fams, "tgw_model_ready", model="mlp") == 1
    assert value(fams, "tgw_model_version_state", model="mlp", version="1", state="ready") == 1
    assert value(fams, "tgw_model_version_weight", model="mlp", version="1") == 100
    assert value(fams, "tgw_breaker_state", model="mlp", version="1", state="closed") == 1
    assert value(fams, "tgw_tenant_rate_limited_total", tenant="slow", reason="rate") == 1
    assert value(fams, "tgw_tenant_admitted_total", tenant="slow") == 1
    # no front processes (no HTTP or gRPC face to serve): none counted, status says so
    assert value(fams, "tgw_front_processes") == 0 and value(fams, "tgw_front_restarts_total") == 0
    assert scraped.status["fronts"]["configured"] == 0 and scraped.status["fronts"]["lives"] == []

def test_a_cpu_broker_has_gpu_families_without_samples(scraped):
    fams = scraped.fams
    gpu = [name for name, _, _ in READINGS] + ["tgw_worker_gpu_oom"]
    assert all(fams[name].samples == [] for name in gpu)        # no GPU here: the families, no figures
    assert "tgw_gpu_" not in "".join(line for line in scraped.text.splitlines() if not line.startswith("#"))
    workers = scraped.status["workers"]
    assert workers and all("gpu" not in w and "gpu_ooms" not in w and "rss" in w for w in workers)


def test_gc_frozen_after_start_in_status_and_metrics(scraped):
    """server.gc_freeze (on by default): the broker froze before serving, the worker before its
    ready; status' `gc` and the tgw_gc_* families show both (shm/gc_watch.py)."""
    broker = scraped.status["gc"]["broker"]
    assert broker["frozen"] is True and broker["frozen_objects"] > 0
    assert broker["collections"]["2"] >= 1 and broker["longest_pause_ms"] >= 0   # the freeze's collection
    with Client(scraped.address) as c:   # the first beats may predate the worker's freeze: wait for one after
        wait_until(lambda: c.status()["gc"]["workers"].get("0", {}).get("frozen"), what="a frozen worker's beat")
        worker = c.status()["gc"]["workers"]["0"]
        fams = parse(scrape(scraped.address))
    assert worker["frozen_objects"] > 0 and worker["collections"]["2"] >= 1
    assert value(fams, "tgw_gc_frozen_objects", process="broker") > 0
    assert value(fams, "tgw_gc_collections_total", process="worker-0", generation="2") >= 1
    assert value(fams, "tgw_gc_longest_pause_seconds", process="broker") >= 0


def test_json_flag_prints_the_reply(scraped):
    assert scraped.reply["op"] == "metrics" and "tgw_requests_total" in scraped.reply["text"]


def test_dashboard_names_only_exposed_metrics(scraped):
    with open(os.path.join(ROOT, "configs", "grafana-tgw.json")) as f:
        board = json.load(f)
    assert board["schemaVersion"] >= 36
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])] + \
        [v["definition"] for v in board["templating"]["list"] if "definition" in v]
    used = {name for e in exprs for name in re.findall(r"\btgw_[a-z0-9_]+", e)}
    assert used and used <= exposable(scraped.fams), sorted(used - exposable(scraped.fams))


def test_operations_doc_lists_exactly_the_exposed_families(scraped):
    """docs/OPERATIONS.md's metric table (its "## Metrics" section) names every family once."""
    with open(os.path.join(ROOT, "docs", "OPERATIONS.md")) as f:
        doc = f.read()
    assert doc.count("\n## Metrics\n") == 1, "docs/OPERATIONS.md has no (or two) '## Metrics' sections"
    section = doc.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `(tgw_[a-z0-9_]+)`", section, re.M)
    exposed = {f.name + ("_total" if f.type == "counter" else "") for f in scraped.fams.values()}
    assert len(listed) == len(set(listed)) and set(listed) == exposed
