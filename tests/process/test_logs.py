"""Structured logs (issue 11): `tgw-broker start --log-format json` writes one JSON object per
line, the workers' lines too; the events (start, worker_ready, model_load, model_unload,
slow_request, slow_batch) carry their fields; slow requests are logged with their phases and
trace id, at most logs.PER_S lines a second."""
from __future__ import annotations

import json
import logging
import sys
from datetime import datetime

import numpy as np
from conftest import base_config, wait_until

from tgw.broker.cli.ask import ask
from tgw.broker.observe.logs import PER_S, JsonFormatter, SlowRequests
from tgw.broker.state.pending import Pending
from tgw.client import Client
from tgw.shm.wire import PROTOCOL_VERSION, LoadVersion
from tgw.workers.tracing import JsonLines

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CALLER = f"00-{TRACE_ID}-b7ad6b7169203331-01"


def lines(b) -> list[dict]:
    """Every line of the broker's output (the workers' included), each parsed as JSON."""
    return [json.loads(line) for line in b.output().splitlines() if line.strip()]


def events(b, name: str) -> list[dict]:
    return [rec for rec in lines(b) if rec.get("event") == name]


def test_json_lines_and_events(make_broker, model_files):
    path = model_files["mlp"][0]
    cfg = base_config(model_files, "mlp")
    cfg["observability"] = {"slow_request_ms": 0.001}   # every request is slow
    b = make_broker(cfg, start=False).start(args=("--log-format", "json"))

    start = wait_until(lambda: events(b, "start"), 10, "the start event")[0]
    assert (start["address"], start["workers"], start["models"]) == (b.address, 1, ["mlp"])
    assert start["level"] == "INFO" and start["logger"] == "tgw.broker" and start["msg"].startswith("serving on")
    assert events(b, "worker_ready")[0]["models"] == ["mlp:1"]

    with Client(b.address) as c:
        c.infer("mlp", {"x": np.zeros((3, 256), np.float32)}, traceparent=CALLER)
    slow = wait_until(lambda: events(b, "slow_request"), 10, "the slow request line")[0]
    assert (slow["model"], slow["version"], slow["code"], slow["trace_id"], slow["rows"]) == \
        ("mlp", "1", "OK", TRACE_ID, 3)
    assert slow["level"] == "WARNING" and slow["request_id"] > 0
    assert 0 <= slow["queue_ms"] <= slow["total_ms"] and 0 < slow["compute_ms"] <= slow["total_ms"]
    batch = wait_until(lambda: events(b, "slow_batch"), 10, "the worker's slow batch line")[0]
    assert batch["logger"] == "tgw.worker" and batch["trace_ids"] == [TRACE_ID] and batch["rows"] == 3

    # a hot swap: version 2 loads, version 1 drains and unloads
    ask(b.address, LoadVersion(v=PROTOCOL_VERSION, model="mlp", version="2", path=path), 60)
    load = wait_until(lambda: events(b, "model_load"), 10, "the model_load event")[0]
    assert load["key"] == "mlp:2" and load["worker"] == "worker0[cpu]" and load["bytes"] > 0
    unload = wait_until(lambda: events(b, "model_unload"), 10, "the model_unload event")[0]
    assert unload["key"] == "mlp:1"

    assert b.stop() == 0
    for rec in lines(b):   # every line, to the last: JSON with the four fields
        assert {"ts", "level", "logger", "msg"} <= set(rec), rec
        assert datetime.fromisoformat(rec["ts"].replace("Z", "+00:00")).tzinfo is not None


def record(msg: str = "m %d", args=(1,), exc=None, **extra) -> logging.LogRecord:
    rec = logging.LogRecord("tgw.test", logging.ERROR, __file__, 1, msg, args, exc)
    rec.__dict__.update(extra)
    return rec


def test_formatters_carry_extra_fields_and_the_exception():
    try:
        raise ValueError("boom")
    except ValueError:
        exc = sys.exc_info()
    for formatter in (JsonFormatter(), JsonLines()):   # the broker's and the workers'
        out = json.loads(formatter.format(record(exc=exc, event="e", figure=1.5, names=["a"])))
        assert (out["level"], out["logger"], out["msg"], out["event"], out["figure"], out["names"]) == \
            ("ERROR", "tgw.test", "m 1", "e", 1.5, ["a"])
        assert "ValueError: boom" in out["exc"] and out["ts"].endswith("Z")


def pending(req_id: int, arrived: float) -> Pending:
    p = Pending(client=b"c", req_id=req_id, model="m", version="1", rows=1, shape_key=(), tensors=[], outputs=[],
                deadline=arrived + 10, arrived=arrived)
    p.dispatched, p.compute_us = arrived + 0.01, 5000
    return p


def test_slow_requests_are_rate_limited(caplog):
    slow = SlowRequests(threshold_ms=50)
    with caplog.at_level(logging.WARNING, logger="tgw.broker"):
        slow([pending(0, 100.0)], None, 100.04)                       # under the threshold
        for i in range(PER_S + 5):                                     # in one second: PER_S lines
            slow([pending(i + 1, 100.0)], "DEADLINE_EXCEEDED", 100.5)
        slow([pending(99, 100.0)], None, 101.6)                         # the next second: says 5 left out
    logged = [r for r in caplog.records if getattr(r, "event", None) == "slow_request"]
    assert [r.request_id for r in logged] == [*range(1, PER_S + 1), 99]
    assert logged[0].code == "DEADLINE_EXCEEDED" and logged[0].queue_ms == 10.0 and logged[0].total_ms == 500.0
    assert logged[-1].left_out == 5 and "5 more slow request(s) not logged" in logged[-1].getMessage()
