"""Hostile or broken input, and replies that could not be delivered: counted, and logged at
most once per kind every INTERVAL_S, so a flood of bad frames cannot flood the log.

Groups: "refused" (input answered with an error before it reached a queue), "dropped"
(replies not delivered), "broker_error" (a bug: logged with its traceback, rate-limited too).
The counts are in the stats reply.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Callable

log = logging.getLogger("tgw.broker")
INTERVAL_S = 10.0


class Complaints:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.counts: dict[str, Counter] = {"refused": Counter(), "dropped": Counter()}
        self._last: dict[tuple, float] = {}
        self._quiet: Counter = Counter()   # (group, kind) -> notes since its last log line

    def note(self, group: str, kind: str, message: str, exc_info: bool = False) -> None:
        self.counts.setdefault(group, Counter())[kind] += 1
        key = (group, kind)
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < INTERVAL_S:
            self._quiet[key] += 1
            return
        self._last[key] = now
        more = self._quiet.pop(key, 0)
        log.warning("%s %s: %s%s", group, kind, message[:300],
                    f" (and {more} more like it in the last {now - last:.0f} s)" if more else "",
                    exc_info=exc_info)

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {group: dict(c) for group, c in self.counts.items()}
