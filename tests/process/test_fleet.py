"""`tgw-bench fleet --quick`: three real brokers behind a real HAProxy (configs/haproxy/tgw.cfg
and tgw-hash.cfg, addresses replaced), closed-loop HTTP load, every answer checked by the bench.

The default run takes the phases whose outcome is a rule - SIGKILL one broker, a rolling restart,
a hot swap behind the consistent-hash variant - and checks: the table is printed, 0 failed requests in the kill and the rolling restart (HAProxy retries a refused
connection, an empty answer and a 503 on another broker, inference being idempotent), every
answer right, versions only the swap's two, no routing key back to the old version behind the
hash variant, and every process the bench started stopped. TGW_SLOW=1 adds the swap behind leastconn,
the scale-up and the scaling phases (their goals are measured figures on a shared 2-core machine: reported, not asserted).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import psutil
import pytest

SLOW = os.environ.get("TGW_SLOW") == "1"
PHASES = "kill,rolling,scale_up,scaling,swap,swap_hash" if SLOW else "kill,rolling,swap_hash"

pytestmark = pytest.mark.skipif(shutil.which("haproxy") is None and not os.path.exists("/usr/sbin/haproxy"),
                                reason="haproxy is not installed (scripts/test.sh installs it)")


@pytest.fixture(scope="module")
def fleet_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("fleet") / "fleet.json")
    proc = subprocess.Popen([sys.executable, "-m", "tgw.bench.cli", "fleet", "--quick", "--phases", PHASES,
                             "--json", out], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        stdout, _ = proc.communicate(timeout=600 if SLOW else 240)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)   # the bench stops what it started, then exits
        stdout, _ = proc.communicate(timeout=90)
        pytest.fail(f"tgw-bench fleet --quick ran past its bound:\n{stdout[-4000:]}")
    with open(out) as f:
        return proc.returncode, stdout, json.load(f)


def test_prints_the_table_and_exits_clean(fleet_run):
    rc, stdout, doc = fleet_run
    assert rc == 0, stdout[-4000:]
    header = next(line for line in stdout.splitlines() if line.startswith("scenario"))
    assert header.split() == ["scenario", "requests", "failed", "retried", "figure", "goal", "met"]
    assert len(doc["table"]) == 1 + len(PHASES.split(","))
    assert doc["haproxy_config"] == "configs/haproxy/tgw.cfg"


def test_kill_and_rolling_restart_fail_nothing(fleet_run):
    results = fleet_run[2]["results"]
    kill, rolling = results["kill"], results["rolling"]
    assert kill["failed"] == 0 and kill["requests"] > 0, kill["errors"]
    assert kill["retries"] + kill["redispatches"] > 0   # the killed broker's share really was retried
    assert rolling["failed"] == 0 and rolling["dropped"] == 0, rolling["errors"]
    assert [s["exit_status"] for s in rolling["steps"]] == [0, 0, 0]


def test_swaps_keep_versions_and_keys_in_order(fleet_run):
    results = fleet_run[2]["results"]
    for name in ("swap", "swap_hash") if SLOW else ("swap_hash",):
        r = results[name]
        assert r["failed"] == 0, (name, r["errors"])
        assert set(r["by_version"]) <= {str(r["old"]), str(r["new"])}, (name, r["by_version"])
        assert str(r["new"]) in r["by_version"], name   # the new version did serve
    assert results["swap_hash"]["backward_count"] == 0, results["swap_hash"]["backward"]


def test_every_process_it_started_is_gone(fleet_run):
    doc = fleet_run[2]
    pids = doc["started_pids"]
    assert len(pids) >= 3 * 2 + 1   # three brokers with a worker each, and HAProxy
    assert not [p for p in pids if _still_ours(p, doc["stopped_at"])]


def _still_ours(pid: int, stopped_at: float) -> bool:
    """Alive and made before the bench stopped (a PID reused since is another process)."""
    try:
        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE and p.create_time() <= stopped_at
    except psutil.NoSuchProcess:
        return False
