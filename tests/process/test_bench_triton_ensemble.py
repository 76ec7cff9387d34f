"""`tgw-bench triton-ensemble` end to end on tiny settings, without PyTriton's environment (CI has
none; bench/README.md says how to make one): tgw serves the stand-in repository's ensemble with
--model-repository, its answers checked against the in-process run of the same code, one short
window at c=4 with no failed request; the missing baseline recorded in the result file with its
reason, and the exit status 1. Structure and zero errors, never timings."""
from __future__ import annotations

import glob
import json

from tgw.bench import cli


def test_the_tgw_row_runs_and_a_missing_pytriton_is_said(tmp_path, capsys):
    rc = cli.main(["triton-ensemble", "--quick", "--duration", "1", "--concurrency", "4",
                   "--pytriton-python", str(tmp_path / "no-venv" / "python"), "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 1, out
    [path] = glob.glob(str(tmp_path / "results" / "triton-ensemble-*-custom.json"))
    res = json.loads(open(path).read())
    assert "error" not in res, res.get("error")
    assert res["pytriton_error"].startswith("RuntimeError: no PyTriton environment at "), res["pytriton_error"]
    tgw = res["rows"]["tgw"]
    assert tgw["requests_ok"] > 0 and tgw["requests_failed"] == 0 and tgw["errors"] == {}, tgw
    assert res["rows"]["pytriton"] == {} and res["goals"][0]["value"] is None
    assert res["server"]["exit_status"] == 0 and res["server"]["shm_leftovers"] == []
    assert "tgw serves ensemble_classify" in out and "answers checked" in out
