"""`tgw-bench generate --quick` end to end: the tiny decoder through every system (the floor,
Flask+gunicorn streaming, tgw one-shot loops, LitServe where installed, tgw generate through
Client and AsyncClient) at 1, 16 and 64 streams, and the small fault rows (cancellation by four
means, a flood against the slot pool, a worker killed under load). Structure, zero failures and every stream's outputs equal to the
model's own greedy run, never timings; the run stops every server it started by PID (the leak
guard checks no child or segment is left)."""
from __future__ import annotations

import json

import pytest

from tgw.bench import cli

pytestmark = [pytest.mark.process, pytest.mark.timeout(600)]


def test_generate_quick_fills_every_row(tmp_path, capsys):
    rc = cli.main(["generate", "--quick", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    files = list((tmp_path / "results").glob("generate-*-quick.json"))
    assert rc == 0 and len(files) == 1, out
    data = json.loads(files[0].read_text())
    assert data["command"] == "tgw-bench generate --quick --out " + str(tmp_path)
    floor = data["floor"]
    assert sorted(floor["levels"], key=int) == ["1", "16", "64"] and floor["prefill_one_ms"] > 0
    assert all(lv["outputs_per_s"] > 0 and lv["step_ms"] > 0 for lv in floor["levels"].values())
    systems = data["systems"]
    assert list(systems) == ["flask", "oneshot", "litserve", "generate", "generate_async"]
    for name, row in systems.items():
        if name == "litserve" and "error" in row:   # an optional extra: the row says why it did not run
            assert "not installed" in row["error"]
            continue
        assert "error" not in row, (name, row)
        assert sorted(row["levels"], key=int) == ["1", "16", "64"]
        for n, lv in row["levels"].items():
            assert lv["requests"] == int(n) * lv["per_stream"] and lv["requests_failed"] == 0, (name, n, lv)
            assert lv["outputs"] == 64 * lv["requests"] and lv["outputs_wrong"] == 0, (name, n, lv)
            assert lv["outputs_checked"] == lv["requests"] and lv["ttfo_ms"]["p50"] > 0
        if name not in ("oneshot", "generate_async"):
            assert row["newcomer"]["others"] == 63 and row["newcomer"]["ttfo_ms"] > 0, row["newcomer"]
    assert systems["generate_async"]["server"] == {"exit_status": 0, "shm_leftovers": []}   # the last tgw row
    faults = data["faults"]
    assert faults["servers"] == {k: {"exit_status": 0, "shm_leftovers": []} for k in ("cancel", "flood")}
    cancel, flood, kill = faults["cancel"], faults["flood"], faults["kill"]
    assert sorted(cancel["by_means"]) == ["cancel", "client_close", "deadline", "process_kill"], cancel
    assert all("error" not in m and m["streams"] == 10 for m in cancel["by_means"].values()), cancel
    assert cancel["bystanders_failed"] == cancel["bystanders_wrong"] == 0
    # the flood: each answered or refused OVERLOADED, never more live sequences than slots
    assert sum(flood["outcomes"].values()) == flood["sequences"] == 300, flood
    assert set(flood["outcomes"]) <= {"answered", "OVERLOADED"} and flood["peak_active"] <= flood["slots"] == 64
    # a worker killed under load: every sequence complete and equal to the model's greedy run
    assert kill["kills"] >= 1 and kill["sequences"] > 0 and kill["failed"] == kill["wrong"] == 0, kill
    goals = {g["goal"]: g for g in data["goals"]}
    assert len(goals) == 8 + 7 and all(g["target"] is not None for g in goals.values())   # async: no newcomer
    assert floor["split"]["procs"] == 2 and all(lv["outputs_per_s"] > 0 for lv in floor["split"]["levels"].values())
    assert all(g["value"] is not None for name, g in goals.items() if "(d)" not in name)
    assert "(e) tgw generate" in out and "newcomer" in out
