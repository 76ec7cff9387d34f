"""`tgw-bench onnx --quick` end to end: the demo resnet exported to ONNX and saved as
TorchScript, onnxruntime's own floor at two batches, one broker serving both at c=64. Structure,
zero errors and tgw's answer equal to onnxruntime's, never timings; the run stops its broker by
PID and removes its folder (the leak guard checks no child or segment is left)."""
from __future__ import annotations

import json

import pytest

from tgw.bench import cli

pytest.importorskip("onnxruntime")


def test_onnx_bench_quick(tmp_path, capsys):
    rc = cli.main(["onnx", "--quick", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    (path,) = (tmp_path / "results").glob("onnx-*-quick.json")
    data = json.loads(path.read_text())
    assert [r["batch"] for r in data["floor"]["runs"]] == [1, 8] and data["floor"]["best"]["rows_per_s"] > 0
    assert sorted(data["rows"]) == ["onnx", "torchscript"]
    for row in data["rows"].values():
        assert row["errors"] == {} and row["requests"] > 0 and row["mean_batch_rows"] >= 1
    assert data["answer_max_abs_diff"] < 1e-4
    assert data["goals"][0]["value"] > 0 and data["onnx_over_torchscript"] > 0
    assert "tgw onnx c=64" in out and "onnxruntime floor (batch" in out
