"""`tgw-bench overload` end to end on tiny settings (a broker of its own, on and off): structure
only (three priority levels, every request answered once, the JSON's fields, the tables and
checks printed), never timings or success rates, which depend on the machine and on the
scheduler. Its pieces on synthetic answers: tests/unit/test_bench_overload.py."""
from __future__ import annotations

import json

from tgw.bench import cli
from tgw.bench.harness import openloop

LEVEL_KEYS = {"priority", "offered", "ok", "success", "latency_ms", "answer_ms_max", "errors", "client_timeouts",
              "other", *openloop.COLUMNS}
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
    assert data["settings"]["mix"] == list(openloop.MIX) and data["capacity_rps"] > 0
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
