"""The soak tool's short mode (tests/tools/soak.py, its own broker with two workers): capacity, then an
open loop at 70% of it for a few seconds. No request may fail and no process may die; the
figures (RSS, fds, threads before and after, latency) are printed (-s), never asserted."""
from __future__ import annotations

from tools import soak


def test_soak_short_run_fails_nothing_and_loses_no_process():
    lines: list[str] = []
    code, s = soak.run(["--seconds", "5", "--capacity-seconds", "2", "--workers", "2"], out=lines.append)
    text = "\n".join(lines)
    print("\n" + text)
    assert s["sent"] > 0 and s["ok"] == s["sent"] and s["errors"] == {}, text
    assert s["died"] == [] and s["restarts"] == 0 and s["exit_status"] == 0, text
    assert [p["role"] for p in s["before"]] == ["broker", "worker", "worker"], text
    assert all(p["alive"] for p in s["after"]), text
    assert code == 0, text
