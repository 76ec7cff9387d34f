"""Wakes the broker's loop the moment a worker process exits.

A process's pidfd (os.pidfd_open, Linux 5.3+) turns readable when the process exits, so it sits
on the loop's selector beside the sockets that bring the workers' hellos: start-up waits on
exits and readiness together, with no interval. Where a pidfd cannot be had (another OS, an
old kernel, a seccomp filter), `polling` is set and the supervisor's periodic look (the
lifecycle's monitor) sees the exit instead, as it always has.
"""
from __future__ import annotations

import asyncio
import logging
import os
import subprocess
from typing import Callable

log = logging.getLogger("tgw.supervisor")


class ExitWatch:
    def __init__(self, loop: asyncio.AbstractEventLoop, on_exit: Callable[[], None]):
        self.loop, self.on_exit = loop, on_exit
        self._fds: dict[int, int] = {}   # pid -> its pidfd, until it fires
        self.polling = False             # some exit is seen only by the periodic look

    def add(self, proc: subprocess.Popen | None) -> None:
        if proc is None:
            return
        try:
            fd = os.pidfd_open(proc.pid)
        except ProcessLookupError:        # gone (and reaped) already: look now
            self.loop.call_soon(self.on_exit)
            return
        except (AttributeError, OSError) as exc:
            if not self.polling:
                log.info("no pidfd for worker exits (%s): they are seen by the periodic look", exc)
            self.polling = True
            return
        self._fds[proc.pid] = fd
        self.loop.add_reader(fd, self._exited, proc.pid)

    def _exited(self, pid: int) -> None:
        self._drop(pid)    # readable stays readable: once is enough
        self.on_exit()

    def _drop(self, pid: int) -> None:
        fd = self._fds.pop(pid, None)
        if fd is not None:
            self.loop.remove_reader(fd)
            os.close(fd)

    def close(self) -> None:
        for pid in list(self._fds):
            self._drop(pid)
