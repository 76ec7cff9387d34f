"""An injected clock for the tests: `clock()` reads `clock.t`, which a test moves by hand."""
from __future__ import annotations


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t
