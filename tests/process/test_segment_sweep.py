"""Shared-memory segments (shm/segment.py) with other processes: a child that attaches never
unlinks (no resource_tracker), however it exits; the stale sweep removes the segments of dead
creators (a real exited child gives the dead pid) and skips what is not a plain segment of this
user's. (The segment itself: tests/unit/test_segment.py.)"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from segment_cases import create, exists, made  # noqa: F401 - made is a fixture
from tgw.shm import segment as seg_mod
from tgw.shm.segment import Segment, list_segments, sweep_stale


CHILD = """
import os, sys
from tgw.shm.segment import Segment
seg = Segment.attach(sys.argv[1])
seg.buf[:5] = b"child"
if sys.argv[2] == "close":
    seg.close()
    sys.exit(0)
os._exit(0)   # no cleanup at all
"""


@pytest.mark.parametrize("how", ["close", "exit"])
def test_child_attach_does_not_unlink(made, how):
    seg = create(made)
    try:
        subprocess.run([sys.executable, "-c", CHILD, seg.name, how], check=True, timeout=30)
        assert exists(seg.name)
        assert bytes(seg.buf[:5]) == b"child"
        again = Segment.attach(seg.name)
        again.close()
    finally:
        seg.close()


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.fixture
def private_shm_dir(tmp_path, monkeypatch):
    """Sweep tests run in a private folder: a sweep of the real /dev/shm could remove the stale
    segments another test (or session) is about to check after a SIGKILL."""
    monkeypatch.setattr(seg_mod, "SHM_DIR", str(tmp_path))
    return tmp_path


def test_sweep_stale_removes_dead_creator_keeps_live(private_shm_dir, made):
    dead = _dead_pid()
    stale = create(made, pid=dead)
    stale.close()
    live = create(made)
    live.close()
    assert stale.name in list_segments(dead)
    removed = sweep_stale()
    assert stale.name in removed
    assert live.name not in removed
    assert not exists(stale.name)
    assert exists(live.name)
    assert stale.name not in sweep_stale()          # nothing left to sweep twice


def test_sweep_ignores_foreign_names(private_shm_dir):
    dead = _dead_pid()
    name = f"tgw_notours_{dead}"                    # does not match the pattern: never touched
    fd = os.open(os.path.join(seg_mod.SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.close(fd)
    sweep_stale()
    assert exists(name)
    assert name not in list_segments()


def test_sweep_skips_a_directory_named_like_a_segment(private_shm_dir, caplog):
    name = f"tgw_ring_{_dead_pid()}_00ab"            # any local user can make this in /dev/shm
    os.mkdir(os.path.join(seg_mod.SHM_DIR, name))
    assert sweep_stale() == []
    assert exists(name) and name in caplog.text     # one log line, and start-up goes on


def test_sweep_skips_a_link_named_like_a_segment(private_shm_dir, caplog):
    target = private_shm_dir / "precious"
    target.write_bytes(b"x")
    name = f"tgw_ring_{_dead_pid()}_00ac"
    os.symlink(target, os.path.join(seg_mod.SHM_DIR, name))
    assert sweep_stale() == []
    assert os.path.islink(os.path.join(seg_mod.SHM_DIR, name)) and target.exists() and name in caplog.text


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_sweep_skips_a_file_of_another_user_even_when_it_could_remove_it(private_shm_dir, caplog):
    name = f"tgw_ring_{_dead_pid()}_00ad"
    path = os.path.join(seg_mod.SHM_DIR, name)
    os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
    os.chown(path, 65534, 65534)
    assert sweep_stale() == []
    assert exists(name) and "not a regular file of this user's" in caplog.text


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_sweep_skips_another_users_segment_it_cannot_unlink(monkeypatch, caplog):
    """/dev/shm is sticky (1777): a user cannot unlink another user's stale segment. The sweep,
    run here by `nobody` on root's segment in a private sticky folder, logs it and goes on."""
    shared = tempfile.mkdtemp(prefix="tgw-sticky-", dir="/tmp")
    try:
        os.chmod(shared, 0o1777)
        monkeypatch.setattr(seg_mod, "SHM_DIR", shared)
        theirs = f"tgw_ring_{_dead_pid()}_00cd"
        os.close(os.open(os.path.join(shared, theirs), os.O_CREAT | os.O_RDWR, 0o600))  # root's
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # the child: become nobody, sweep, report
            os.close(read)
            code = 1
            try:
                os.setgid(65534)
                os.setuid(65534)
                removed = sweep_stale()
                os.write(write, json.dumps({"removed": removed, "log": caplog.text}).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        with os.fdopen(read) as f:
            report = f.read()
        assert os.waitpid(child, 0)[1] == 0, "the sweep raised instead of skipping"
        result = json.loads(report)
        assert result["removed"] == []
        assert theirs in result["log"] and "left in place" in result["log"]
        assert exists(theirs)
    finally:
        shutil.rmtree(shared, ignore_errors=True)
