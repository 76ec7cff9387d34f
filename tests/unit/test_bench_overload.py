"""`tgw-bench overload`'s pieces on synthetic answers (the harness's open loop by priority: its
classification, per-level rows, targets and table) and its usage errors; structure only, never
timings or success rates. The run end to end: tests/process/test_bench_overload_run.py."""
from __future__ import annotations

import numpy as np
import pytest

from tgw.bench import cli
from tgw.bench.harness import openloop
from tgw.client import TgwError
from tgw.shm.errors import Code, fail


def test_classify_tells_the_clients_give_up_from_the_brokers():
    assert openloop.classify(fail(Code.DEADLINE_EXCEEDED, "no reply", source="client")) == openloop.CLIENT_TIMEOUT
    assert openloop.classify(fail(Code.DEADLINE_EXCEEDED, "deadline passed while queued")) == "DEADLINE_EXCEEDED"
    assert openloop.classify(fail(Code.OVERLOADED, "shed")) == "OVERLOADED"
    assert isinstance(fail(Code.OVERLOADED, "x"), TgwError)
    assert openloop.classify(RuntimeError("boom")) == "RuntimeError"


def test_level_rows_and_checks_on_synthetic_answers():
    prio = np.array([0, 0, 1, 1, 2, 2, 2], dtype=np.uint8)
    code = np.array(["ok", "ok", "ok", "OVERLOADED", "RATE_LIMITED", openloop.CLIENT_TIMEOUT, "INTERNAL"])
    lat = np.array([0.01, 0.02, 0.03, 0.001, 0.001, 0.3, 0.002])
    raw = {"prio": prio, "code": code, "lat": lat, "lag": np.zeros(7), "scheduled": 7, "sent": 7, "answered": 7,
           "stuck_threads": 0, "messages": {}, "generator": {"procs": 1, "threads": [4], "cpu_cores_per_proc": [0.1]}}
    run = openloop.summarise(raw, True, 7.0, 1.0)
    p0, p1, p2 = run["levels"]
    assert (p0["offered"], p0["ok"], p0["success"]) == (2, 2, 1.0)
    assert p1["OVERLOADED"] == 1 and p1["success"] == 0.5
    assert p2["RATE_LIMITED"] == 1 and p2["client_timeouts"] == 1 and p2["other"] == {"INTERNAL": 1}
    assert run["all"]["offered"] == 7 and run["all"]["ok"] == 3
    assert p0["latency_ms"]["p50"] == pytest.approx(15.0) and p2["latency_ms"]["p50"] is None
    res = {c["check"]: c["pass"] for c in openloop.checks(run, slo_ms=100)}
    assert list(res.values()) == [True, True, True, False, True]
    assert len(openloop.level_table(run)) == 1 + 3 + 1
    run["answered"] = 6
    assert openloop.checks(run, 100)[-1]["pass"] is False


def test_usage_errors_exit_2(capsys):
    assert cli.main(["overload", "--duration", "0"]) == 2
    assert "must be > 0" in capsys.readouterr().err
