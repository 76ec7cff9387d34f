"""Tracing end to end (issue 11): the W3C traceparent on the native face, carried to the worker
and back; OpenTelemetry spans written by the file exporter (the broker's request span with its
phases, the worker's batch span linked to the caller's context); and nothing of opentelemetry
loaded in a broker or worker that does not trace.

Real broker and worker processes; spans are read from the JSON-lines file the exporter
appends to. Times are checked for order and containment only.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from datetime import datetime

import numpy as np
import pytest
from conftest import base_config, wait_until

from tgw.testing.child import BrokerProc
from tgw.client import Client, TgwError

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
CALLER = f"00-{TRACE_ID}-{CALLER_SPAN}-01"
X = np.zeros((2, 256), np.float32)
PHASES = ("admission", "queue", "compute", "reply")

# written into a sitecustomize on the untraced broker's PYTHONPATH: each process (broker and
# workers) appends, as it exits, the opentelemetry modules it loaded
PROBE = """
import atexit, json, os, sys
def _report():
    loaded = sorted(m for m in sys.modules if m == "opentelemetry" or m.startswith("opentelemetry."))
    with open(os.environ["TGW_PROBE_OUT"], "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "argv": sys.argv[:3], "otel": loaded}) + "\\n")
atexit.register(_report)
"""


def spans(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def of_trace(path: str, trace_id: str) -> list[dict]:
    return [s for s in spans(path) if s["context"]["trace_id"] == f"0x{trace_id}"]


def t(span: dict, key: str) -> datetime:
    return datetime.fromisoformat(span[key].replace("Z", "+00:00"))


def request_tree(path: str, trace_id: str) -> dict:
    """name -> span of the one tgw.request of `trace_id` and its children, once all are written."""
    found = {s["name"]: s for s in of_trace(path, trace_id)}
    return found if {"tgw.request", *PHASES} <= set(found) else {}


@pytest.fixture(scope="module")
def traced(model_files):
    """One tracing broker for the module: spans in spans.jsonl beside its config."""
    d = tempfile.mkdtemp(prefix="tgwt-", dir="/tmp")
    cfg = base_config(model_files, "mlp", "fails")
    cfg["observability"] = {"tracing": {"exporter": "file", "path": "spans.jsonl"}}   # relative: to the config
    b = BrokerProc(cfg, d).start()
    b.spans = os.path.join(d, "spans.jsonl")
    yield b
    code = b.stop()
    shutil.rmtree(d, ignore_errors=True)
    assert code == 0, f"broker exited {code} on SIGTERM:\n{b.output()}"


def test_traceparent_round_trip_and_spans(traced):
    with Client(traced.address) as c:
        r = c.infer_with_meta("mlp", {"x": X}, traceparent=CALLER)
    assert r.outputs["y"].shape == (2, 10) and (r.model, r.version) == ("mlp", "1")
    version, trace_id, span_id, flags = r.traceparent.split("-")
    # the same trace comes back, in the broker's own request span
    assert (version, trace_id, flags) == ("00", TRACE_ID, "01") and span_id != CALLER_SPAN

    tree = wait_until(lambda: request_tree(traced.spans, TRACE_ID), 10, "the request's spans in the file")
    req = tree["tgw.request"]
    assert req["parent_id"] == f"0x{CALLER_SPAN}" and req["context"]["span_id"] == f"0x{span_id}"
    assert req["kind"] == "SpanKind.SERVER" and req["status"]["status_code"] == "UNSET"
    assert req["attributes"]["tgw.model"] == "mlp" and req["attributes"]["tgw.version"] == "1"
    assert req["attributes"]["tgw.rows"] == 2 and req["attributes"]["tgw.code"] == "OK"
    for name in PHASES:   # children of the request span, within it
        child = tree[name]
        assert child["parent_id"] == req["context"]["span_id"], name
        assert t(req, "start_time") <= t(child, "start_time") <= t(child, "end_time") <= t(req, "end_time"), name
    # the phases in order: admitted, queued, computed, answered
    assert t(tree["admission"], "end_time") <= t(tree["queue"], "start_time")
    assert t(tree["queue"], "end_time") <= t(tree["compute"], "start_time")
    assert t(tree["compute"], "end_time") <= t(tree["reply"], "start_time")
    assert tree["compute"]["attributes"]["tgw.compute_us"] > 0

    # the worker's batch span, linked to the caller's span
    def batch_span():
        return [s for s in spans(traced.spans) if s["name"] == "tgw.batch" and
                any(link["context"]["trace_id"] == f"0x{TRACE_ID}" for link in s["links"])]
    batch = wait_until(batch_span, 10, "the worker's batch span")[0]
    link = next(lk for lk in batch["links"] if lk["context"]["trace_id"] == f"0x{TRACE_ID}")
    assert link["context"]["span_id"] == f"0x{CALLER_SPAN}"
    assert batch["attributes"]["tgw.model"] == "mlp" and batch["attributes"]["tgw.rows"] >= 2
    assert batch["resource"]["attributes"]["service.instance.id"].startswith("worker-")
    assert req["resource"]["attributes"]["service.instance.id"] == f"broker-{traced.pid}"


def test_invalid_traceparent_starts_a_new_trace(traced):
    bad = ["00-" + "0" * 32 + f"-{CALLER_SPAN}-01", f"00-{TRACE_ID}-{'0' * 16}-01", f"01-{TRACE_ID}-{CALLER_SPAN}-01",
           CALLER.upper(), "not a traceparent"]
    seen = set()
    with Client(traced.address) as c:
        for value in bad:
            r = c.infer_with_meta("mlp", {"x": X}, traceparent=value)
            version, trace_id, _, flags = r.traceparent.split("-")
            assert version == "00" and trace_id not in (TRACE_ID, "0" * 32) and int(flags, 16) & 1, value  # sampled
            seen.add(trace_id)
        plain = c.infer_with_meta("mlp", {"x": X})   # none sent: a new trace too
    assert len(seen) == len(bad)
    trace_id = plain.traceparent.split("-")[1]
    tree = wait_until(lambda: request_tree(traced.spans, trace_id), 10, "the new trace's spans")
    assert tree["tgw.request"]["parent_id"] is None   # the root of its trace
    wait_until(lambda: "invalid traceparent" in traced.output(), 10, "the ignored traceparent in the log")


def test_failed_request_span_has_error_status(traced):
    with Client(traced.address) as c:
        with pytest.raises(TgwError) as info:
            c.infer("fails", {"x": -np.ones((1, 2), np.float32)}, traceparent=CALLER)
    code = info.value.code.value
    errored = wait_until(lambda: [s for s in of_trace(traced.spans, TRACE_ID) if s["name"] == "tgw.request"
                                  and s["attributes"]["tgw.model"] == "fails"], 10, "the failed request's span")
    assert errored[0]["status"]["status_code"] == "ERROR" and errored[0]["attributes"]["tgw.code"] == code


def test_untraced_broker_echoes_and_loads_no_opentelemetry(make_broker, model_files, tmp_path):
    (tmp_path / "sitecustomize.py").write_text(PROBE)
    out = tmp_path / "modules.jsonl"
    b = make_broker(base_config(model_files, "mlp"), start=False)
    b.start(env={"PYTHONPATH": str(tmp_path), "TGW_PROBE_OUT": str(out)})
    with Client(b.address) as c:
        assert c.infer_with_meta("mlp", {"x": X}, traceparent=CALLER).traceparent == CALLER   # the caller's own
        assert c.infer_with_meta("mlp", {"x": X}, traceparent="00-junk").traceparent is None    # ignored
        assert c.infer_with_meta("mlp", {"x": X}).traceparent is None
    assert b.stop() == 0
    reports = [json.loads(line) for line in out.read_text().splitlines()]
    assert any(r["pid"] == b.pid for r in reports) and any("workers" in " ".join(r["argv"]) for r in reports), reports
    assert all(r["otel"] == [] for r in reports), reports


def test_tracing_config_is_checked(model_files, monkeypatch):
    from tgw.broker.config import schema
    from tgw.broker.config.load import ConfigError, parse_config

    def check(tracing: dict) -> str:
        cfg = {**base_config(model_files, "mlp"), "observability": {"tracing": tracing}}
        with pytest.raises(ConfigError) as info:
            parse_config(cfg, "/")
        return str(info.value)

    assert "path is required" in check({"exporter": "file"})
    assert "sample_ratio" in check({"exporter": "console", "sample_ratio": 2})
    if not schema._importable("opentelemetry.exporter.otlp"):   # this venv: no OTLP exporter
        assert "pip install opentelemetry-exporter-otlp" in check({"exporter": "otlp"})
    monkeypatch.setattr(schema, "_importable", lambda module: False)   # as without tgw[tracing]
    assert "pip install 'tgw[tracing]'" in check({"exporter": "console"})


def test_unsampled_caller_gets_its_trace_back_and_nothing_written(traced):
    quiet, loud = "1" * 32, "2" * 32
    with Client(traced.address) as c:
        r = c.infer_with_meta("mlp", {"x": X}, traceparent=f"00-{quiet}-{CALLER_SPAN}-00")   # not sampled
        c.infer("mlp", {"x": X}, traceparent=f"00-{loud}-{CALLER_SPAN}-01")
    _, trace_id, span_id, flags = r.traceparent.split("-")
    assert (trace_id, flags) == (quiet, "00") and span_id != CALLER_SPAN
    wait_until(lambda: request_tree(traced.spans, loud), 10, "the sampled request's spans")
    # spans are written as they end, in order: the unsampled request's would be there by now
    assert of_trace(traced.spans, quiet) == []
    assert not [s for s in spans(traced.spans) for link in s["links"] if link["context"]["trace_id"] == f"0x{quiet}"]
