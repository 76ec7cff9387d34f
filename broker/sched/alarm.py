"""One timer that wakes the broker's pump at the earliest time anyone asked for: a held batch
that is due, or the next queued request to expire."""
from __future__ import annotations

import asyncio
from typing import Callable


class Alarm:
    def __init__(self, loop: asyncio.AbstractEventLoop, wake: Callable[[], None]):
        self.loop, self.wake = loop, wake
        self._timer: asyncio.TimerHandle | None = None
        self._at = 0.0

    def at(self, when: float, now: float) -> None:
        """Wake at `when` (clock seconds; `now` is the clock now), unless already set to wake sooner."""
        if self._timer is not None:
            if self._at <= when:
                return
            self._timer.cancel()
        self._at = when
        self._timer = self.loop.call_later(max(0.0, when - now), self._ring)

    def _ring(self) -> None:
        self._timer = None
        self.wake()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
