"""`tgw-bench overload` end to end on tiny settings, and its pieces on synthetic answers:
structure only (three priority levels, every request answered once, the JSON's fields), never
timings or success rates, which depend on the machine and on the scheduler."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tgw.bench import cli, overload, overload_load
from tgw.client import TgwError
from tgw.shm.errors import Code, fail

LEVEL_KEYS = {"priority", "offered", "ok", "success", "latency_ms", "answer_ms_max", "errors", "client_timeouts",
              "other", *overload.COLUMNS}
RUN_KEYS = {"adaptive_concurrency", "rate_rps", "duration_s", "scheduled", "sent", "answered", "unanswered",
            "levels", "all", "send_lag_ms", "generator", "warnings", "checks", "capacity_rps", "broker_answers",
            "broker_exit_status", "shm_leftovers", "config"}


def test_overload_on_and_off_end_to_end(tmp_path, capsys):
    out = tmp_path / "overload.json"
    rc = cli.main(["overload", "--duration", "1.5", "--capacity-seconds", "0.5", "--warmup", "0.2",
                   "--capacity-concurrency", "4", "--factor", "1", "--procs", "1", "--max-inflight", "32",
                   "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text  # 0: every request got its answer (targets may fail: printed, not asserted)
    data = json.loads(out.read_text())
    assert data["command"].startswith("tgw-bench overload")
    assert data["settings"]["mix"] == list(overload.MIX) and data["capacity_rps"] > 0
    assert set(data["runs"]) == {"on", "off"} and data["comparison"].startswith("priority 0 p99")
    for mode, run in data["runs"].items():
        assert RUN_KEYS <= set(run), RUN_KEYS - set(run)
        assert run["adaptive_concurrency"] is (mode == "on")
        assert run["config"]["adaptive_concurrency"] is (mode == "on") and run["config"]["priority_levels"] == 3
        assert run["scheduled"] > 0 and run["answered"] == run["sent"] == run["scheduled"] and run["unanswered"] == 0
        assert [lv["priority"] for lv in run["levels"]] == [0, 1, 2]
        for lv in [*run["levels"], run["all"]]:
            assert LEVEL_KEYS <= set(lv)
            assert lv["offered"] == lv["ok"] + sum(lv["errors"].values())
        assert sum(lv["offered"] for lv in run["levels"]) == run["all"]["offered"] == run["answered"]
        assert [c["target"] for c in run["checks"]] == [mode == "on"] * 3 + [True, True]
        assert run["checks"][-1]["pass"] is True  # answered == sent
        assert run["broker_exit_status"] == 0 and run["shm_leftovers"] == []
    # one table per run (header, rule, the three levels and the total), five checks each, the comparison
    lines = text.splitlines()
    heads = [i for i, line in enumerate(lines) if line.split()[:4] == ["priority", "offered", "ok", "success"]]
    assert len(heads) == 2, text
    for i in heads:
        assert [row.split()[0] for row in lines[i + 2:i + 6]] == ["0", "1", "2", "all"]
    assert sum(line.startswith(("  PASS  ", "  FAIL  ")) for line in lines) == 10
    assert "priority 0 p99:" in text


def test_classify_tells_the_clients_give_up_from_the_brokers():
    assert overload_load.classify(fail(Code.DEADLINE_EXCEEDED, "no reply", source="client")) == overload_load.CLIENT_TIMEOUT
    assert overload_load.classify(fail(Code.DEADLINE_EXCEEDED, "deadline passed while queued")) == "DEADLINE_EXCEEDED"
    assert overload_load.classify(fail(Code.OVERLOADED, "shed")) == "OVERLOADED"
    assert isinstance(fail(Code.OVERLOADED, "x"), TgwError)
    assert overload_load.classify(RuntimeError("boom")) == "RuntimeError"


def test_level_rows_and_checks_on_synthetic_answers():
    prio = np.array([0, 0, 1, 1, 2, 2, 2], dtype=np.uint8)
    code = np.array(["ok", "ok", "ok", "OVERLOADED", "RATE_LIMITED", overload_load.CLIENT_TIMEOUT, "INTERNAL"])
    lat = np.array([0.01, 0.02, 0.03, 0.001, 0.001, 0.3, 0.002])
    raw = {"prio": prio, "code": code, "lat": lat, "lag": np.zeros(7), "scheduled": 7, "sent": 7, "answered": 7,
           "stuck_threads": 0, "messages": {}, "generator": {"procs": 1, "threads": [4], "cpu_cores_per_proc": [0.1]}}
    run = overload.summarise(raw, True, 7.0, 1.0)
    p0, p1, p2 = run["levels"]
    assert (p0["offered"], p0["ok"], p0["success"]) == (2, 2, 1.0)
    assert p1["OVERLOADED"] == 1 and p1["success"] == 0.5
    assert p2["RATE_LIMITED"] == 1 and p2["client_timeouts"] == 1 and p2["other"] == {"INTERNAL": 1}
    assert run["all"]["offered"] == 7 and run["all"]["ok"] == 3
    assert p0["latency_ms"]["p50"] == pytest.approx(15.0) and p2["latency_ms"]["p50"] is None
    res = {c["check"]: c["pass"] for c in overload.checks(run, slo_ms=100)}
    assert list(res.values()) == [True, True, True, False, True]
    assert len(overload.level_table(run)) == 1 + 3 + 1
    run["answered"] = 6
    assert overload.checks(run, 100)[-1]["pass"] is False


def test_usage_errors_exit_2(capsys):
    assert cli.main(["overload", "--duration", "0"]) == 2
    assert "must be > 0" in capsys.readouterr().err
