"""Per-tenant quotas: a token bucket (requests/s with a burst) and a cap on requests in flight.

A request names its tenant (`tenant` on the wire, Client.infer(tenant=) or $TGW_TENANT). One
naming no configured tenant gets the default tenant's quota - shared with the default tenant
itself, so cycling through made-up names buys nothing - or, with `require_tenant`, is refused
UNAUTHENTICATED. Without a default tenant such requests are not limited here (the adaptive
concurrency limit and the queue bounds still hold).
"""
from __future__ import annotations

import math
import time
from typing import Callable

from tgw.shm.errors import Code, fail

from tgw.broker.config.schema import TenantDecl


class TokenBucket:
    """`rate` tokens per second, at most `burst` saved up; starts full."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic):
        self.rate, self.burst, self.clock = rate, float(burst), clock
        self.tokens, self.stamp = float(burst), clock()

    def _fill(self, now: float) -> None:
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now

    def take(self, now: float | None = None) -> float:
        """Take one token: 0.0 when granted, else the seconds until one will be there."""
        self._fill(self.clock() if now is None else now)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate

    def refund(self) -> None:
        """Give back a token taken for a request that was then refused for another reason."""
        self.tokens = min(self.burst, self.tokens + 1.0)


class Tenant:
    __slots__ = ("name", "bucket", "max_inflight", "inflight", "limited", "admitted")

    def __init__(self, name: str, decl: TenantDecl, clock: Callable[[], float]):
        self.name = name
        self.bucket = TokenBucket(decl.rate, decl.burst, clock)
        self.max_inflight = decl.max_inflight
        self.inflight = 0                     # admitted, not yet answered
        self.limited = {"rate": 0, "inflight": 0}
        self.admitted = 0

    def as_dict(self) -> dict:
        return {"rate": self.bucket.rate, "burst": int(self.bucket.burst), "tokens": round(self.bucket.tokens, 2),
                "max_inflight": self.max_inflight, "inflight": self.inflight, "admitted": self.admitted,
                "limited": dict(self.limited)}


class Tenants:
    def __init__(self, decls: dict[str, TenantDecl], default: str | None, required: bool,
                 clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.by_name = {name: Tenant(name, d, clock) for name, d in decls.items()}
        self.default = self.by_name.get(default) if default else None
        self.required = required
        self.in_use = bool(self.by_name)  # without tenants, resolve() has nothing to say

    def resolve(self, name: str | None) -> Tenant | None:
        """The tenant whose quota a request counts against (None: not limited here)."""
        t = self.by_name.get(name) if name is not None else None
        if t is not None:
            return t
        if self.required:
            what = f"unknown tenant {name!r}" if name is not None else "no tenant named"
            raise fail(Code.UNAUTHENTICATED, f"{what}; this broker requires one of its configured tenants "
                       "(require_tenant: true; clients pass tenant= or TGW_TENANT)", tenant=name)
        return self.default

    def admit(self, t: Tenant, now: float, slot_free_in: float = 0.001) -> None:
        """Count one request against `t` or raise RATE_LIMITED (details.retry_after_ms: when a
        token will be there, or `slot_free_in` seconds, the caller's estimate of when one of
        the tenant's requests in flight will be answered)."""
        if t.max_inflight is not None and t.inflight >= t.max_inflight:
            t.limited["inflight"] += 1
            raise fail(Code.RATE_LIMITED, f"tenant {t.name!r} has {t.inflight} requests in flight, its limit "
                       f"(tenants.{t.name}.max_inflight)", tenant=t.name, reason="tenant_inflight",
                       max_inflight=t.max_inflight,
                       retry_after_ms=max(1, math.ceil(slot_free_in * 1000)))
        wait = t.bucket.take(now)
        if wait > 0:
            t.limited["rate"] += 1
            raise fail(Code.RATE_LIMITED, f"tenant {t.name!r} is over its rate of {t.bucket.rate:g} requests/s "
                       f"(burst {int(t.bucket.burst)})", tenant=t.name, reason="tenant_rate",
                       retry_after_ms=max(1, math.ceil(wait * 1000)))
        t.inflight += 1
        t.admitted += 1

    def unadmit(self, t: Tenant) -> None:
        """Undo admit() for a request refused after it (its token back, its slot free)."""
        t.bucket.refund()
        t.inflight -= 1
        t.admitted -= 1

    def as_dict(self) -> dict:
        return {name: t.as_dict() for name, t in self.by_name.items()}
