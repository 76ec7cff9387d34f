"""What the segment tests share (tests/unit/test_segment.py, tests/process/test_segment_sweep.py):
the `made` fixture that unlinks what a test created, and the helpers that create and look."""
from __future__ import annotations

import os

import pytest

from tgw.shm import segment as seg_mod
from tgw.shm.segment import Segment, new_name


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
