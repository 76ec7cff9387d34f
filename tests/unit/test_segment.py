"""Shared-memory segments (shm/segment.py): os.open + mmap, mode 0600, names that tell the
creator's pid, scoped views. (With other processes - no resource_tracker unlink from an attaching
process, the stale sweep: tests/process/test_segment_sweep.py.)"""
from __future__ import annotations

import os
import re
import stat

import numpy as np
import pytest

from segment_cases import create, exists, made  # noqa: F401 - made is a fixture
from tgw.shm import segment as seg_mod
from tgw.shm.segment import SHM_DIR, Segment, ShmError, free_bytes, list_segments, new_name
from tgw.shm.views import block_view
from tgw.shm.wire import BlockTensor


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


def test_free_bytes():
    assert free_bytes() > 0
