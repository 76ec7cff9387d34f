"""The opt-in retry policy: retryable errors only, exponential back-off with jitter, bounded by
the call's deadline.

Retryable means the error says so (`TgwError.retryable`: OVERLOADED, RATE_LIMITED,
MODEL_NOT_READY, CIRCUIT_OPEN, OUT_OF_*, WORKER_DIED, UNAVAILABLE), except a WORKER_DIED
marked `poison` (the broker will not run that request again). A `retry_after_ms` the broker
sends (CIRCUIT_OPEN, a model loading) is waited at least. An inference is assumed to be
idempotent: after UNAVAILABLE it may have run once already.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass

from tgw.shm.errors import TgwError


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 3              # tries in all, the first included
    backoff: float = 0.05          # seconds before the first retry
    max_backoff: float = 2.0       # no wait grows past this
    multiplier: float = 2.0        # each wait this many times the one before
    jitter: float = 0.5            # each wait is drawn from [1 - jitter, 1] times its value

    def __post_init__(self):
        if self.attempts < 1 or self.backoff < 0 or self.max_backoff < 0 or self.multiplier < 1 \
                or not 0 <= self.jitter <= 1:
            raise ValueError(f"invalid retry policy {self}: attempts >= 1, backoff and max_backoff >= 0, "
                             "multiplier >= 1, 0 <= jitter <= 1")

    def delay(self, err: BaseException, attempt: int, left: float | None) -> float | None:
        """Seconds to wait before try `attempt + 1` after `err` ended try `attempt` (1-based), or
        None to give up: not retryable, no tries left, or the wait would reach past the deadline
        (`left`: seconds to it; None: no deadline)."""
        if not isinstance(err, TgwError) or not err.retryable or err.details.get("poison"):
            return None
        if attempt >= self.attempts:
            return None
        wait = min(self.max_backoff, self.backoff * self.multiplier ** (attempt - 1))
        wait *= 1 - self.jitter * random.random()
        wait = max(wait, err.details.get("retry_after_ms", 0) / 1000)
        if left is not None and wait >= left:
            return None
        return wait


REREGISTER = "reregister"   # Attempts.after: register the call's region again, then try at once


class Attempts:
    """One call's tries under a policy (None: a single try) and its timeout (None: none); `region`:
    the call's shared-memory region, registered again (once) when the broker no longer knows it."""

    def __init__(self, policy: RetryPolicy | None, timeout: float | None, region=None):
        self.policy, self.timeout, self.region = policy, timeout, region
        self.started, self.attempt = time.monotonic(), 1

    def left(self) -> float | None:
        """What is left of the timeout for the next try (the first: the timeout as given, which
        the request checks)."""
        if self.timeout is None or self.attempt == 1:
            return self.timeout
        return max(0.0, self.timeout - (time.monotonic() - self.started))

    def after(self, err: BaseException) -> float | str | None:
        """The wait before the next try after `err`; REREGISTER when the broker does not know the
        call's region (it restarted: not counted as a try); None: raise it."""
        if self.region is not None and getattr(err, "details", {}).get("reason") == "unknown_region":
            self.region = None
            return REREGISTER
        if self.policy is None:
            return None
        wait = self.policy.delay(err, self.attempt, self.left())
        self.attempt += 1
        return wait
