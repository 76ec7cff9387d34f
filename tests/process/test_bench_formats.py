"""`tgw-bench formats` end to end on tiny settings: the demo mlp as TorchScript and as a
torch.export program (no AOTInductor build, to keep the suite fast), its in-process floors and
one broker serving both, driven at c=1 and c=64. Structure and zero errors, never timings; the
run stops its broker by PID and removes its folder (the leak guard checks no child or segment
is left)."""
from __future__ import annotations

import json

import pytest

from tgw.bench import cli
from tgw.bench.harness.report import formats_rows, formats_table


def test_format_rows_smoke(tmp_path, capsys):
    out = tmp_path / "rows.json"
    rc = cli.main(["formats", "--duration", "0.5", "--warmup", "0.2", "--floor-seconds", "0.05", "--floor-rounds", "1",
                   "--models", "mlp", "--formats", "torchscript,export", "--json", str(out)])
    assert rc == 0, capsys.readouterr()
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [(r["model"], r["format"], r["concurrency"]) for r in rows] == [
        ("mlp", "torchscript", 1), ("mlp", "torchscript", 64), ("mlp", "export", 1), ("mlp", "export", 64)]
    for r in rows:
        assert r["error"] is None and r["errors"] == {} and r["requests"] > 0, r
        assert r["floor_rows_per_s"] > 0 and r["tgw_over_floor"] > 0
        assert r["floor_batch"] == (1 if r["concurrency"] == 1 else 64)   # the demo mlp's max_batch_size
    assert data["floor"]["mlp-export"]["loaded"].startswith("export")
    text = capsys.readouterr().out
    assert "| mlp | export | 64 |" in text and data["skipped"] == []


def test_format_rows_refuses_an_unknown_format(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["formats", "--formats", "torchscript,onnx"])
    assert exc.value.code == 2 and "onnx" in capsys.readouterr().err


def test_a_refused_program_gets_rows_saying_why():
    """A program that failed the pre-check at 1 or max_batch_size rows is not served: its rows
    carry the reason, and the table prints it (no broker needed)."""
    why = "RuntimeError: input_handles[0]: dim value is too small at 0, expected it to be >= 2, but got: 1"
    rows = formats_rows({"resnet-aoti": {"base": "resnet", "format": "aoti"}}, {}, {},
                                  {"resnet-aoti": why})
    assert [r["concurrency"] for r in rows] == [1, 64]
    assert all(r["error"] == f"not served: {why}" and "rps" not in r for r in rows)
    assert formats_table(rows).count(why) == 2
