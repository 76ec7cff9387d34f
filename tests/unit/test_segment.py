"""Shared-memory segments (shm/segment.py): os.open + mmap, mode 0600, names that tell the
creator's pid, no resource_tracker unlink from an attaching process, scoped views, stale sweep."""
from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from tgw.shm import segment as seg_mod
from tgw.shm.segment import SHM_DIR, Segment, ShmError, free_bytes, list_segments, new_name, sweep_stale
from tgw.shm.views import block_view
from tgw.shm.wire import BlockTensor


@pytest.fixture
def made():
    """Names created by a test; every one is unlinked afterwards, whatever happened."""
    names: list[str] = []
    yield names
    for name in names:
        seg_mod.unlink(name)


def create(made: list[str], size: int = 4096, kind: str = "ring", pid: int | None = None) -> Segment:
    name = new_name(kind, pid)
    made.append(name)
    return Segment.create(name, size)


def exists(name: str) -> bool:
    return os.path.exists(os.path.join(seg_mod.SHM_DIR, name))


def test_name_pattern():
    name = new_name("ring")
    assert re.fullmatch(rf"tgw_ring_{os.getpid()}_[0-9a-f]+", name)
    assert re.fullmatch(r"tgw_ring_12345_[0-9a-f]{8}", new_name("ring", 12345))
    assert new_name("ring") != new_name("ring")


def test_create_attach_close_unlink(made):
    seg = create(made, 8192)
    try:
        assert seg.owner and seg.size == 8192 and len(seg.buf) == 8192
        assert seg.path == os.path.join(SHM_DIR, seg.name) and SHM_DIR == "/dev/shm"
        st = os.stat(seg.path)
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_size == 8192
        assert st.st_blocks * 512 >= 8192          # posix_fallocate reserved the pages
        assert seg.name in list_segments(os.getpid())
        assert seg.name in list_segments()
        seg.buf[:5] = b"hello"
        other = Segment.attach(seg.name)
        try:
            assert not other.owner and other.size == 8192
            assert bytes(other.buf[:5]) == b"hello"
            other.buf[100:103] = b"abc"
            assert bytes(seg.buf[100:103]) == b"abc"
        finally:
            other.close()
        other.close()                               # idempotent
    finally:
        seg.close()
    assert exists(seg.name)                         # close does not unlink
    seg.unlink()
    assert not exists(seg.name)
    assert seg_mod.unlink(seg.name) is False        # second unlink: nothing there
    assert seg.name not in list_segments()


def test_create_existing_name_fails(made):
    seg = create(made)
    try:
        with pytest.raises(FileExistsError):
            Segment.create(seg.name, 4096)
        assert exists(seg.name)                     # the failed create left the original alone
    finally:
        seg.close()


def test_attach_missing_fails():
    with pytest.raises(FileNotFoundError):
        Segment.attach(new_name("ring"))


def test_create_bad_size_leaves_nothing(made):
    name = new_name("ring")
    made.append(name)
    with pytest.raises(OSError):
        Segment.create(name, 0)
    assert not exists(name)


def test_shm_error_is_oserror():
    assert issubclass(ShmError, OSError)


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


def test_close_refused_while_numpy_view_alive(made):
    seg = create(made)
    view = np.frombuffer(seg.buf, dtype=np.uint8)
    view[:3] = [1, 2, 3]
    assert bytes(seg.buf[:3]) == b"\x01\x02\x03"
    with pytest.raises(BufferError):
        seg.close()
    assert view[:3].tolist() == [1, 2, 3]           # the view still reads the mapping
    del view
    seg.close()
    seg.close()


def test_close_refused_while_block_view_alive(made):
    seg = create(made)
    t = BlockTensor(name="x", dtype="float32", shape=[2, 4], offset=64, nbytes=32)
    arr = block_view(seg.buf, t)
    arr[:] = 1.5
    assert arr.shape == (2, 4)
    assert np.frombuffer(bytes(seg.buf[64:96]), dtype=np.float32).tolist() == [1.5] * 8
    with pytest.raises(BufferError):
        seg.close()
    del arr
    seg.close()


def test_close_refused_while_slice_view_alive(made):
    seg = create(made)
    view = np.frombuffer(seg.buf[64:128], dtype=np.uint8)
    with pytest.raises(BufferError):
        seg.close()
    del view
    seg.close()


def test_refused_close_leaves_segment_usable(made):
    seg = create(made)
    t = BlockTensor(name="x", dtype="uint8", shape=[64], offset=64, nbytes=64)
    view = block_view(seg.buf, t)
    try:
        with pytest.raises(BufferError):
            seg.close()
        seg.buf[0] = 7                              # must still work after the refusal
        assert seg.buf[0] == 7
    finally:
        del view
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


def test_free_bytes():
    assert free_bytes() > 0


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
