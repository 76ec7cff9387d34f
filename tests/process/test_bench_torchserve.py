"""`tgw-bench torchserve --quick` end to end: the two archives the real torch-model-archiver makes
(the built-in text classifier, the custom Pillow image handler) served by the real TorchServe and
by tgw's `--model-store` face, each loaded at c=1 and c=4 on /predictions. Structure, zero
failed requests, each system's answer right (the text one equal to the archive's own weights
computed in-process, the image one tgw's equal to TorchServe's), both servers stopped by PID
with nothing left behind, the handler's in-process floor filled - never timings. Without java the TorchServe side is recorded as
skipped with its reason and tgw's still runs. A long mode (a real JVM, about 30 s): TGW_SLOW=1 runs it;
tests/process/test_torchserve.py proves the archives served by tgw in the default run."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from tgw.bench import cli

pytestmark = [pytest.mark.process, pytest.mark.timeout(300),
              pytest.mark.skipif(os.environ.get("TGW_SLOW") != "1", reason="a long mode: TGW_SLOW=1 runs it")]


def test_torchserve_quick_serves_both_archives_on_both_systems(tmp_path, capsys):
    argv = ["torchserve", "--quick", "--out", str(tmp_path)]
    rc = cli.main(argv)
    out = capsys.readouterr().out
    files = list((tmp_path / "results").glob("torchserve-*-quick.json"))
    assert len(files) == 1, out
    data = json.loads(files[0].read_text())
    assert rc == 0, out
    assert data["command"] == " ".join(["tgw-bench", *argv])
    java = shutil.which("java") is not None
    rows = data["rows"]
    assert list(rows) == ["torchserve", "tgw"]
    if not java:
        assert rows["torchserve"] == {"skipped": rows["torchserve"]["skipped"]} and "java" in rows["torchserve"]["skipped"]
    ran = ["torchserve", "tgw"] if java else ["tgw"]
    for system in ran:
        for archive in ("text", "image"):
            levels = rows[system][archive]
            assert sorted(levels, key=int) == ["1", "4"], (system, archive, levels)
            for n, row in levels.items():
                assert "error" not in row, (system, archive, n, row.get("error"))
                assert row["requests_ok"] > 0 and row["requests_failed"] == 0, (system, archive, n, row["errors"])
                roles = {p["role"] for p in row["server_processes"]}
                front = "frontend" if system == "torchserve" else "broker"
                assert front in roles and len(roles) == 2, roles   # the front process and its workers
                assert all(p["cpu_us_per_request"] is not None for p in row["server_processes"]), row
    if java:
        assert rows["torchserve"]["server"] == {"exit_status": 0, "left": []}
    assert rows["tgw"]["server"] == {"exit_status": 0, "shm_leftovers": []}
    # the image archive's model-config.yaml gives both the same batching
    for system in ran:
        described = rows[system]["describe"]["imgclf"][0]
        assert (described["batchSize"], described["maxBatchDelay"]) == (8, 5), (system, described)
    # the text answer equals the archive's weights run in-process; tgw's image answer equals TorchServe's
    expect = {"text/tgw": True, **({"text/torchserve": True, "image/tgw=torchserve": True} if java else {})}
    assert data["answer_checks"] == expect, data["answers"]
    assert set(data["answers"]["text"]["tgw"]) == {"World", "Sports", "Business", "Sci/Tech"}
    # the handler alone in one process (ts's loader, Service.predict), and each row's CPU beside it
    for archive, batch in (("text", 1), ("image", 8)):
        assert data["floor"][archive]["batch"] == batch and data["floor"][archive]["cpu_us_per_request"] > 0
        for n in ("1", "4"):
            cell = data["cpu_per_request"][archive][n]
            assert cell["tgw"] > 0 and cell["floor"] > 0 and ("torchserve/tgw" in cell) == java, cell
    goals = {g["goal"]: g for g in data["goals"]}
    assert sorted(g.split(" (")[0] for g in goals) == ["image: p50 at c=1, tgw/TorchServe",
                                                       "text: p50 at c=1, tgw/TorchServe"]
    assert all((g["value"] is not None) == java for g in goals.values()), goals
