"""`tgw-bench gc-pauses` end to end on tiny settings, the gc_freeze-off row only (one broker start
is the cost; the on row's freeze, in status and metrics: tests/process/test_metrics.py):
structure, every request answered, the setting reaching the broker and its worker (not frozen,
status' `gc`), never timings or pause lengths, which depend on the machine. The figures'
source: tests/unit/test_gc_watch.py."""
from __future__ import annotations

import json

from tgw.bench import cli


def test_gc_pauses_without_the_freeze_end_to_end(tmp_path, capsys):
    rc = cli.main(["gc-pauses", "--quick", "--duration", "1", "--warmup", "0.2", "--concurrency", "8",
                   "--only", "off", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    (path,) = (tmp_path / "results").glob("gc-pauses-*-custom.json")
    data = json.loads(path.read_text())
    assert data["command"].startswith("tgw-bench gc-pauses") and list(data["rows"]) == ["off"]
    for setting, row in data["rows"].items():
        frozen = setting == "on"
        assert row["gc_freeze"] is frozen and row["requests_ok"] > 0 and row["requests_failed"] == 0
        assert row["server"] == {"exit_status": 0, "shm_leftovers": []}
        assert {"p50", "p99", "p99_9", "max"} <= set(row["latency_ms"])
        for figures in [row["broker_gc"], *row["workers_gc"].values()]:
            assert figures["frozen"] is frozen and (figures["frozen_objects"] > 0) is frozen
            assert set(figures["collections"]) == {"0", "1", "2"} and figures["longest_pause_ms"] >= 0
        assert list(row["workers_gc"]) == ["0"] and row["gen0_per_1000_requests"] >= 0
    assert [g["unit"] for g in data["goals"]] == ["ms", "ms", "x"] and data["goals"][0]["target"] == 1.0
    assert data["goals"][0]["value"] is None and data["goals"][0]["met"] is None   # the goal is the on row's
    assert "longest pause ms" in out and "gc_freeze off:" in out
