"""POSIX shared-memory segments mapped with os.open + mmap.

Python's multiprocessing.shared_memory registers every attached segment with the
resource_tracker, which unlinks it when the attaching process exits; mapping /dev/shm files
directly keeps ownership explicit: the creator (the supervisor) alone unlinks.
Names: tgw_<kind>_<creatorpid>_<rand>, so a sweep can tell whose creator is dead.
"""
from __future__ import annotations

import errno
import mmap
import os
import re
import logging
import secrets
import stat

log = logging.getLogger("tgw.shm")
SHM_DIR = "/dev/shm"
PREFIX = "tgw_"
_NAME_RE = re.compile(r"^tgw_([a-z0-9]+)_(\d+)_([0-9a-f]+)$")


class ShmError(OSError):
    pass


def new_name(kind: str, creator_pid: int | None = None) -> str:
    return f"{PREFIX}{kind}_{creator_pid or os.getpid()}_{secrets.token_hex(4)}"


class Segment:
    """One mapped segment. `buf` is a writable memoryview of the whole mapping."""

    def __init__(self, name: str, size: int, mm: mmap.mmap, owner: bool):
        self.name, self.size, self.owner = name, size, owner
        self._mm = mm
        self.buf = memoryview(mm)

    @property
    def path(self) -> str:
        return os.path.join(SHM_DIR, self.name)

    @classmethod
    def create(cls, name: str, size: int) -> "Segment":
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            try:
                # Reserve the pages now: a full /dev/shm fails here, not with SIGBUS later.
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                os.unlink(path)
                if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                    raise ShmError(exc.errno, f"no room in {SHM_DIR} for {size >> 20} MiB segment {name}; "
                                   f"free {free_bytes() >> 20} MiB (raise --shm-size for containers "
                                   "or lower workers.input_arena_mb/output_arena_mb)") from None
                raise
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(name, size, mm, owner=True)

    @classmethod
    def attach(cls, name: str) -> "Segment":
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(name, size, mm, owner=False)

    def close(self) -> None:
        """Unmap; raises BufferError while numpy/torch views of the mapping are alive."""
        if self._mm is None:
            return
        self.buf.release()
        try:
            self._mm.close()
        except BufferError:
            self.buf = memoryview(self._mm)  # still mapped and usable; the caller may retry later
            raise
        self._mm = None

    def unlink(self) -> None:
        unlink(self.name)


def unlink(name: str) -> bool:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
        return True
    except FileNotFoundError:
        return False


def free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_segments(creator_pid: int | None = None) -> list[str]:
    """tgw segments in /dev/shm, optionally only those made by one creator."""
    names = []
    for name in os.listdir(SHM_DIR):
        m = _NAME_RE.match(name)
        if m and (creator_pid is None or int(m.group(2)) == creator_pid):
            names.append(name)
    return sorted(names)


def sweep_stale() -> list[str]:
    """Unlink tgw segments whose creator process is gone; returns the names removed.

    Only regular files owned by this user are touched: any local user can create an entry named
    like a stale segment (a directory, a link, a file of theirs), and none of those is ours to
    clean; each is skipped with one log line. Never fails."""
    removed = []
    for name in list_segments():
        pid = int(_NAME_RE.match(name).group(2))
        if _pid_alive(pid):
            continue
        try:
            st = os.lstat(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            log.warning("%s/%s left in place: not a regular file of this user's (mode %o, uid %d)",
                        SHM_DIR, name, st.st_mode, st.st_uid)
            continue
        try:
            if unlink(name):
                removed.append(name)
        except OSError as exc:
            log.warning("stale segment %s left in place: %s", name, exc.strerror or exc)
    return removed
