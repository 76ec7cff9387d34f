"""scripts/install-service.sh and the systemd unit it installs.

The script runs for real only under --root in tmp_path (no user, no daemon-reload, no venv:
it says so); the steps that need the machine's root (user, venv, daemon-reload) are checked in
--dry-run form, which changes nothing. No network, nothing left on the machine.

`systemd-analyze verify` checks that the unit's binaries exist, so it runs on a copy whose
/opt/tgw/ prefix points into the temporary install root (stub tgw-broker there); every other
byte is the real unit's. Its output is judged line by line: a line naming our unit is an error
in the unit and fails the test; other lines come from the host (its own units that After= or
WantedBy= pull in, a missing manager) and are shown, not failed on. Where a trivial probe unit
does not verify cleanly, systemd-analyze cannot run here and the test is skipped.
"""
from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from recipes import unit_directives

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "install-service.sh"
UNIT = REPO / "scripts" / "systemd" / "tgw-broker.service"
PYTHON = sys.executable
TGW_BROKER = str(Path(PYTHON).parent / "tgw-broker")
STEPS = ("group", "user", "gpu-access", "venv", "state-dirs", "demo-models", "config",
         "check-config", "unit", "systemd")
# What the script installs on the target system (paths inside the files are these).
TARGET = {"unit": "/etc/systemd/system/tgw-broker.service", "config": "/etc/tgw/tgw.yaml",
          "snapshots": "/var/lib/tgw/snapshots", "models": "/var/lib/tgw/models",
          "broker": "/opt/tgw/.venv/bin/tgw-broker"}
REAL_INSTALL = ("/etc/tgw", "/opt/tgw", "/var/lib/tgw", TARGET["unit"])
TIMEOUT_S = 60


def install(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TGW_INSTALL_ROOT"}
    proc = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          env=env, timeout=TIMEOUT_S)
    if check:
        assert proc.returncode == 0, f"install-service.sh {' '.join(args)} failed:\n{proc.stdout}{proc.stderr}"
    return proc


def in_root(root: Path, target: str) -> Path:
    return root / target.lstrip("/")


def step_lines(out: str) -> dict[str, list[str]]:
    """step -> its lines' messages, from 'install-service: STEP: message'."""
    steps: dict[str, list[str]] = {}
    for line in out.splitlines():
        m = re.match(r"install-service: ([a-z-]+): (.*)", line)
        if m:
            steps.setdefault(m.group(1), []).append(m.group(2))
    return steps


def tree(root: Path) -> dict[str, tuple]:
    """Every entry under root: mode, and for files their bytes and mtime (a rewrite shows)."""
    found = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        data = path.read_bytes() if stat.S_ISREG(st.st_mode) else None
        found[str(path.relative_to(root))] = (st.st_mode, data, st.st_mtime_ns if data is not None else None)
    return found


def seconds(value: str) -> float:
    m = re.fullmatch(r"(\d+)(s|min)?", value)
    assert m, f"unexpected time span {value!r}"
    return int(m.group(1)) * (60 if m.group(2) == "min" else 1)


# ---- dry runs -----------------------------------------------------------------------------

def test_dry_run_under_root_lists_every_step_and_writes_nothing(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    out = install("--dry-run", "--root", str(root), "--python", PYTHON).stdout
    steps = step_lines(out)
    assert set(STEPS) <= set(steps), f"steps missing from the dry run:\n{out}"
    for step in ("group", "user", "gpu-access", "venv", "check-config", "systemd"):
        assert any(m.startswith("skipped") for m in steps[step]), f"{step} not said to be skipped:\n{out}"
    for target in (TARGET["snapshots"], TARGET["models"], TARGET["unit"]):
        assert any(m.startswith("would") and str(in_root(root, target)) in m for ms in steps.values() for m in ms), \
            f"no action for {target}:\n{out}"
    assert any("would write" in m and str(in_root(root, TARGET["config"])) in m for m in steps["config"])
    assert any("would run" in m and "tgw.workers.demo_models" in m for m in steps["demo-models"])
    assert "nothing was changed" in out
    assert list(root.iterdir()) == [], "a dry run created files"


def test_dry_run_on_the_real_root_plans_user_venv_and_reload_and_changes_nothing():
    present = [p for p in REAL_INSTALL if os.path.lexists(p)]
    try:
        pwd.getpwnam("tgw")
        present.append("user tgw")
    except KeyError:
        pass
    if present:
        pytest.skip(f"tgw is installed on this machine ({', '.join(present)}): the plan would differ")
    out = install("--dry-run").stdout
    steps = step_lines(out)
    assert set(STEPS) <= set(steps), out
    assert "would run: groupadd --system tgw" in steps["group"]
    (useradd,) = [m for m in steps["user"] if "useradd" in m]
    assert "--system" in useradd and "nologin" in useradd and "/var/lib/tgw" in useradd
    venv = "\n".join(steps["venv"])
    assert "-m venv /opt/tgw/.venv" in venv
    assert "/opt/tgw/.venv/bin/pip install --disable-pip-version-check torch==2.13.0" in venv
    assert re.search(rf"pip install --disable-pip-version-check {re.escape(str(REPO))}\\?\[server\\?\]", venv), venv
    assert any("would write /etc/tgw/tgw.yaml" in m for m in steps["config"])
    if os.path.isdir("/run/systemd/system"):
        assert "would run: systemctl daemon-reload" in steps["systemd"]
    else:
        assert steps["systemd"][0].startswith("skipped")
    assert "systemctl enable --now tgw-broker" in out  # printed for the operator, never run
    assert "nothing was changed" in out
    assert not [p for p in REAL_INSTALL if os.path.lexists(p)], "a dry run touched the machine"
    with pytest.raises(KeyError):
        pwd.getpwnam("tgw")


# ---- real runs under --root ---------------------------------------------------------------

def test_install_under_root_then_rerun_changes_nothing(tmp_path):
    root = tmp_path / "root"
    first = install("--root", str(root), "--python", PYTHON).stdout

    unit = in_root(root, TARGET["unit"])
    assert unit.read_bytes() == UNIT.read_bytes()
    assert stat.S_IMODE(unit.stat().st_mode) == 0o644
    snapshots = in_root(root, TARGET["snapshots"])
    assert snapshots.is_dir() and stat.S_IMODE(snapshots.stat().st_mode) == 0o750
    assert stat.S_IMODE(snapshots.parent.stat().st_mode) == 0o750
    config = in_root(root, TARGET["config"])
    assert stat.S_IMODE(config.stat().st_mode) == 0o644
    assert "venv" in step_lines(first) and step_lines(first)["venv"][0].startswith("skipped")

    # The config names the target's absolute model paths: check it with them pointing into the
    # root (the one change), as the unit's ExecStartPre will check it on the target.
    text = config.read_text()
    assert text.count(TARGET["models"] + "/") == 4   # model_roots and the three model paths
    moved = tmp_path / "tgw.yaml"
    moved.write_text(text.replace(TARGET["models"] + "/", str(in_root(root, TARGET["models"])) + "/"))
    check = subprocess.run([TGW_BROKER, "check-config", str(moved)], capture_output=True, text=True,
                           timeout=TIMEOUT_S)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "OK (3 model(s): mlp, resnet, embed)" in check.stdout

    # The config spells out the demo models' declarations: they must agree with the builder's.
    built = json.loads(subprocess.run([PYTHON, "-m", "tgw.workers.demo_models", str(in_root(root, TARGET["models"]))],
                                      capture_output=True, text=True, check=True, timeout=TIMEOUT_S).stdout)
    declared = {m["name"]: m for m in yaml.safe_load(text)["models"]}
    assert set(declared) == set(built)
    for name, decl in built.items():
        got = declared[name]
        assert got["versions"] == [{"version": "1", "path": TARGET["models"] + "/" + os.path.basename(decl["path"])}]
        assert (got["inputs"], got["outputs"], got["max_batch_size"]) == \
               (decl["inputs"], decl["outputs"], decl["max_batch_size"]), name

    # An operator edits the config; a second run leaves it and every other file as they are.
    config.write_text(text.replace("threads_per_worker: 1", "threads_per_worker: 2") + "# operator was here\n")
    before = tree(root)
    second = install("--root", str(root), "--python", PYTHON).stdout
    assert tree(root) == before, "the second run changed files"
    assert "install-service: nothing to change" in second
    for step, messages in step_lines(second).items():
        for m in messages:
            assert m.startswith(("unchanged", "skipped", "note")), f"{step}: {m}\n{second}"
    assert "operator was here" in config.read_text()


def test_existing_config_is_kept_and_a_changed_unit_is_replaced(tmp_path):
    root = tmp_path / "root"
    config = in_root(root, TARGET["config"])
    config.parent.mkdir(parents=True)
    config.write_text("# the operator's own config\n")
    out = install("--root", str(root)).stdout  # no --python: the demo models are not needed
    steps = step_lines(out)
    assert steps["demo-models"][0].startswith("skipped"), out
    assert config.read_text() == "# the operator's own config\n"
    assert not any(in_root(root, TARGET["models"]).iterdir())

    unit = in_root(root, TARGET["unit"])
    unit.write_text(unit.read_text().replace("WatchdogSec=30", "WatchdogSec=5"))
    out = install("--root", str(root)).stdout
    assert any(m.startswith("replace") for m in step_lines(out)["unit"]), out
    assert unit.read_bytes() == UNIT.read_bytes()


def test_bad_arguments_are_refused(tmp_path):
    proc = install("--frobnicate", check=False)
    assert proc.returncode != 0 and "unknown argument" in proc.stderr


# ---- the unit -----------------------------------------------------------------------------

def test_unit_keeps_the_service_contract_and_its_hardening():
    from tgw.broker import config

    sup = getattr(config, "SupervisorDecl", None)  # supervisor.shutdown_grace_s, where it exists
    default_grace = sup().shutdown_grace_s if sup else 30.0

    d = unit_directives(UNIT.read_text())
    one = {k: v[-1] for k, v in d.items()}
    s = "Service."
    assert one[s + "Type"] == "notify" and one[s + "NotifyAccess"] == "main"
    assert seconds(one[s + "WatchdogSec"]) > 1
    assert d[s + "ExecStartPre"] == [f"{TARGET['broker']} check-config {TARGET['config']}"]
    assert d[s + "ExecStart"] == [f"{TARGET['broker']} start --config {TARGET['config']}"]
    assert one[s + "User"] == one[s + "Group"] == "tgw"
    # SIGTERM to the broker alone, so it drains while its workers finish their batches.
    assert one[s + "KillSignal"] == "SIGTERM" and one[s + "KillMode"] == "mixed"
    # Above the drain plus the workers' stop, with room for a shutdown grace of up to 60 s.
    assert seconds(one[s + "TimeoutStopSec"]) >= max(default_grace, 60) + 15
    assert seconds(one[s + "TimeoutStartSec"]) > config.WorkersDecl().start_timeout_s
    assert one[s + "RuntimeDirectory"] == "tgw" and one[s + "StateDirectory"] == "tgw"
    assert one[s + "NoNewPrivileges"] == "yes" and one[s + "ProtectSystem"] == "strict"
    assert one[s + "ProtectHome"] == "yes" and one[s + "LimitMEMLOCK"] == "infinity"
    assert "/dev/shm" in " ".join(d[s + "ReadWritePaths"]).split()
    # GPUs: a device policy that lets the NVIDIA nodes through, and /dev left whole.
    assert one[s + "DevicePolicy"] in ("closed", "strict")
    assert {"char-nvidia rw", "char-nvidia-uvm rw"} <= set(d[s + "DeviceAllow"])
    assert one.get(s + "PrivateDevices", "no") == "no"
    # torch's JIT and CUDA need writable+executable memory.
    assert one.get(s + "MemoryDenyWriteExecute", "no") == "no"
    assert "AF_UNIX" in one.get(s + "RestrictAddressFamilies", "AF_UNIX")


def systemd_analyze_verify(unit_file: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit_file)], capture_output=True,
                          text=True, timeout=TIMEOUT_S, cwd=unit_file.parent,
                          env={**os.environ, "SYSTEMD_LOG_COLOR": "0", "SYSTEMD_PAGER": ""})


def test_unit_passes_systemd_analyze_verify(tmp_path):
    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze is not installed")
    probe = tmp_path / "probe" / "tgw-probe.service"
    probe.parent.mkdir()
    probe.write_text(f"[Service]\nType=oneshot\nExecStart={shutil.which('true') or '/bin/true'}\n")
    try:
        result = systemd_analyze_verify(probe)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"systemd-analyze cannot run here: {exc}")
    if result.returncode != 0 or (result.stdout + result.stderr).strip():
        pytest.skip(f"systemd-analyze verify fails on a trivial unit here (rc {result.returncode}): "
                    f"{(result.stdout + result.stderr).strip()[:500]}")

    root = tmp_path / "root"
    config = in_root(root, TARGET["config"])
    config.parent.mkdir(parents=True)
    config.write_text("# stands in for the operator's config\n")
    install("--root", str(root))
    installed = in_root(root, TARGET["unit"]).read_text()
    broker = in_root(root, TARGET["broker"])
    broker.parent.mkdir(parents=True)
    broker.write_text("#!/bin/sh\nexit 0\n")
    broker.chmod(0o755)
    prefix = str(in_root(root, "/opt/tgw")) + "/"
    copy = tmp_path / "verify" / "tgw-broker.service"
    copy.parent.mkdir()
    copy.write_text(installed.replace("/opt/tgw/", prefix))
    assert copy.read_text().replace(prefix, "/opt/tgw/") == UNIT.read_text()  # only the prefix moved

    result = systemd_analyze_verify(copy)
    lines = [ln for ln in (result.stdout + result.stderr).splitlines() if ln.strip()]
    ours = [ln for ln in lines if "tgw-broker.service" in ln or str(copy) in ln]
    noise = [ln for ln in lines if ln not in ours]
    if noise:
        print("systemd-analyze lines about the host, not our unit (ignored):", *noise, sep="\n  ")
    assert not ours, "systemd-analyze verify complains about the unit:\n" + "\n".join(ours)
    assert result.returncode == 0, f"systemd-analyze verify exited {result.returncode}:\n" + "\n".join(lines)
