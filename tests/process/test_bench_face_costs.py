"""`tgw-bench faces --quick --fronts 2` end to end: Flask + gunicorn and one broker with two front
processes, every face at c=64 (native AsyncClient, HTTP binary, unary gRPC on one channel, one
gRPC stream) and the c=1 rows. Structure, zero failures, every CPU figure read (the scheduler
loop's share within the broker's, the broker's and the fronts' within the tree's, the fronts'
pids from status), every goal computed from the same run - never timings; the broker stopped by
PID with exit 0 and no segment left."""
from __future__ import annotations

import json

import pytest

from tgw.bench import cli

pytestmark = [pytest.mark.process, pytest.mark.timeout(300)]


def test_faces_quick_fills_every_row_and_goal(tmp_path, capsys):
    argv = ["faces", "--quick", "--fronts", "2", "--out", str(tmp_path)]
    rc = cli.main(argv)
    out = capsys.readouterr().out
    files = list((tmp_path / "results").glob("faces-*-custom.json"))
    assert len(files) == 1, out
    data = json.loads(files[0].read_text())
    assert rc == 0, out
    assert data["command"] == " ".join(["tgw-bench", *argv])
    assert data["servers"]["fronts=2"] == {"exit_status": 0, "shm_leftovers": []}
    block = data["fronts"]["2"]
    assert block["fronts_live"] == 2 and len(block["front_pids"]) == 2 and block["note"] is None, block
    rows = block["rows"]
    assert list(rows) == ["native", "http", "grpc", "grpc-stream", "flask-c1", "native-c1", "flask-c1-wrk", "http-c1"]
    for face, row in rows.items():
        assert "error" not in row and row["requests_ok"] > 0 and row["requests_failed"] == 0, (face, row)
        if face.startswith("flask"):
            continue
        c = 1 if face.endswith("-c1") else 64
        assert row["level"] == c and row["broker_stats"]["requests"] > 0, (face, row)
        cpu = row["cpu"]["cpu_s"]
        assert 0 < cpu["loop"] <= cpu["broker"] + 0.02 and cpu["broker"] <= cpu["tree"], (face, cpu)   # a tick apart
        assert abs(cpu["tree"] - cpu["broker"] - cpu["fronts"]) < 0.002, (face, cpu)
        if face != "native" and face != "native-c1":   # the HTTP and gRPC faces are parsed in the fronts
            assert cpu["fronts"] > 0 and row["cpu"]["fronts_counted"]["forwarded"] == 0, (face, row["cpu"])
        assert row["cpu_us_per_request"]["generator"] > 0, face
    goals = {g["goal"]: g for g in data["goals"]}
    assert len(goals) == 7 and all(g["value"] is not None and g["fronts"] == 2 for g in goals.values()), goals
    predicted = block["predicts"]
    assert list(predicted) == ["native", "http", "grpc", "grpc-stream"]
    assert all(p["req_per_s_with_n_fronts"]["1"] > 0 for p in predicted.values()), predicted
