"""`tgw-bench generate-faces --quick` and `tgw-bench sequences --quick` end to end: the tiny
decoder streamed over every face of one broker (native AsyncClient, tritonclient's gRPC stream,
HTTP generate_stream, the `openai` client) and the tiny sequence model against its one-shot twin.
Structure, zero failures, every token face's outputs equal to the model's greedy run and every
sequence's last output equal to the in-process run - never timings; each broker stopped by PID
with exit 0 and no segment left."""
from __future__ import annotations

import json

import pytest

from tgw.bench import cli

pytestmark = [pytest.mark.process, pytest.mark.timeout(300)]


def _result(tmp_path, capsys, argv: list[str], pattern: str) -> dict:
    rc = cli.main([*argv, "--out", str(tmp_path)])
    out = capsys.readouterr().out
    files = list((tmp_path / "results").glob(pattern))
    assert len(files) == 1, out
    data = json.loads(files[0].read_text())
    assert rc == 0, out
    assert data["command"] == " ".join(["tgw-bench", *argv, "--out", str(tmp_path)])
    assert data["server"] == {"exit_status": 0, "shm_leftovers": []}
    return data


def test_generate_faces_quick_fills_every_face(tmp_path, capsys):
    data = _result(tmp_path, capsys, ["generate-faces", "--quick"], "generate-faces-*-quick.json")
    faces = data["faces"]
    assert list(faces) == ["native", "grpc", "http", "openai"]
    for name, row in faces.items():
        assert "error" not in row and sorted(row["levels"], key=int) == ["16", "64"], (name, row)
        for n, lv in row["levels"].items():
            assert lv["requests"] == int(n) and lv["requests_failed"] == 0, (name, n, lv["errors"])
            assert lv["outputs"] == 64 * lv["requests"] and lv["broker_cpu_us_per_output"] > 0, (name, n)
            assert lv["ttfo_ms"]["p50"] > 0 and lv["ttfo_ms"]["p99"] >= lv["ttfo_ms"]["p50"]
            if name != "openai":   # token faces: each stream is the model's greedy continuation
                assert lv["outputs_checked"] == lv["requests"] and lv["outputs_wrong"] == 0, (name, n, lv)
    goals = {g["goal"]: g for g in data["goals"]}
    assert len(goals) == 6 and all(g["value"] is not None and g["target"] == 0.8 for g in goals.values()), goals


def test_sequences_quick_fills_both_rows(tmp_path, capsys):
    data = _result(tmp_path, capsys, ["sequences", "--quick"], "sequences-*-quick.json")
    for name, row in data["rows"].items():
        assert row["steps"] == 16 * 10 and row["steps_per_s"] > 0, (name, row)
        assert row["sequences_failed"] == 0 and row["sequences_checked"] == 16 and row["sequences_wrong"] == 0, row
    # the broker's own counters: every step dispatched to its sequence's worker, every sequence ended by its flag
    counters = data["broker_sequences"]
    assert counters["steps"] == 16 * 10 and counters["misrouted"] == data["misrouted_steps"] == 0, counters
    assert counters["started"] == 16 and counters["ended"] == {"end": 16} and counters["live"] == 0, counters
    goals = [g["goal"] for g in data["goals"]]
    assert len(goals) == 2 and all(g["value"] is not None for g in data["goals"])
