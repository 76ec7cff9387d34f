"""A guarded rollout's verdict from what was observed (docs/ROLLOUT.md) - pure, no broker state.

A broken bound rolls the version back at once: the largest output difference from the first
request compared, rates and p99 once `min_requests` requests were seen (one early failure is
no rate). With every bound kept, it is promoted once `promote_after_requests` requests were
seen, or `promote_after_s` passed with at least `min_requests` seen, whichever comes first.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from tgw.shm.errors import Code, fail
from tgw.shm.wire import RolloutPolicy

PROMOTE, ROLLBACK, WAIT = "promote", "rollback", "wait"
FRACTIONS = ("max_error_rate", "min_top1_agreement", "min_exact_agreement")
POSITIVE = ("promote_after_s", "max_p99_ms", "max_p99_ratio")
NON_NEGATIVE = ("max_abs_diff", "max_rel_error")
SHADOW_ONLY = ("max_abs_diff", "max_rel_error", "min_top1_agreement", "min_exact_agreement")


@dataclass
class Observed:
    """What a guard has seen of its version since it started."""
    requests: int = 0                  # answered or failed (canary), compared or failed (shadow)
    errors: int = 0
    elapsed_s: float = 0.0
    p99_ms: Optional[float] = None     # canary: end to end; shadow: its batches' compute
    serving_p99_ms: Optional[float] = None   # the serving version's, the same way, same window
    max_abs_diff: Optional[float] = None
    max_rel_error: Optional[float] = None
    top1_agreement: Optional[float] = None
    exact_agreement: Optional[float] = None

    def figures(self) -> dict:
        out = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items() if v is not None}
        if self.requests:
            out["error_rate"] = round(self.errors / self.requests, 6)
        return out


def checked(policy: RolloutPolicy, shadow: bool) -> RolloutPolicy:
    """The policy, or the INVALID_ARGUMENT that names its first wrong field."""
    def bad(field: str, why: str):
        return fail(Code.INVALID_ARGUMENT, f"rollout policy {field} {why}, got {getattr(policy, field)!r}",
                    reason="bad_policy", field=field)
    for field in FRACTIONS:
        value = getattr(policy, field)
        if value is not None and not 0 <= value <= 1:
            raise bad(field, "must be a share in [0, 1]")
    for field in POSITIVE:
        value = getattr(policy, field)
        if value is not None and not value > 0:
            raise bad(field, "must be > 0")
    for field in NON_NEGATIVE:
        value = getattr(policy, field)
        if value is not None and not value >= 0:
            raise bad(field, "must be >= 0")
    if policy.promote_after_requests is not None and policy.promote_after_requests < 1:
        raise bad("promote_after_requests", "must be >= 1")
    if policy.min_requests < 1:
        raise bad("min_requests", "must be >= 1")
    if not shadow:
        used = [f for f in SHADOW_ONLY if getattr(policy, f) is not None]
        if used:
            raise bad(used[0], "compares outputs, which only a shadow has (a canary answers its callers itself); "
                      "is only for a shadow load")
    return policy


def verdict(policy: RolloutPolicy, seen: Observed) -> tuple[str, str]:
    """(promote, rollback or wait, why in words with the numbers)."""
    broken = _broken(policy, seen)
    if broken:
        return ROLLBACK, broken
    enough = seen.requests >= policy.min_requests
    if policy.promote_after_requests is not None and seen.requests >= max(policy.promote_after_requests,
                                                                           policy.min_requests):
        return PROMOTE, f"{seen.requests} requests (promote_after_requests {policy.promote_after_requests}) " \
                        "with every bound kept"
    if policy.promote_after_s is not None and enough and seen.elapsed_s >= policy.promote_after_s:
        return PROMOTE, f"{seen.elapsed_s:.1f} s (promote_after_s {policy.promote_after_s:g}) and " \
                        f"{seen.requests} requests with every bound kept"
    return WAIT, ""


def _broken(p: RolloutPolicy, s: Observed) -> str:
    """The first bound broken, in words ("": none)."""
    if p.max_abs_diff is not None and s.max_abs_diff is not None and s.max_abs_diff > p.max_abs_diff:
        return f"max |diff| {s.max_abs_diff:.3g} > max_abs_diff {p.max_abs_diff:g}"
    if p.max_rel_error is not None and s.max_rel_error is not None and s.max_rel_error > p.max_rel_error:
        return f"relative error {s.max_rel_error:.3g} > max_rel_error {p.max_rel_error:g}"
    if s.requests < p.min_requests:
        return ""
    rate = s.errors / s.requests
    if p.max_error_rate is not None and rate > p.max_error_rate:
        return f"error rate {rate:.2%} ({s.errors} of {s.requests}) > max_error_rate {p.max_error_rate:g}"
    if p.min_top1_agreement is not None and s.top1_agreement is not None and s.top1_agreement < p.min_top1_agreement:
        return f"top-1 agreement {s.top1_agreement:.2%} < min_top1_agreement {p.min_top1_agreement:g}"
    if p.min_exact_agreement is not None and s.exact_agreement is not None and \
            s.exact_agreement < p.min_exact_agreement:
        return f"exact agreement {s.exact_agreement:.2%} < min_exact_agreement {p.min_exact_agreement:g}"
    if s.p99_ms is not None:
        if p.max_p99_ms is not None and s.p99_ms > p.max_p99_ms:
            return f"p99 {s.p99_ms:.2f} ms > max_p99_ms {p.max_p99_ms:g}"
        if p.max_p99_ratio is not None and s.serving_p99_ms and s.p99_ms > p.max_p99_ratio * s.serving_p99_ms:
            return f"p99 {s.p99_ms:.2f} ms > max_p99_ratio {p.max_p99_ratio:g} x the serving version's " \
                   f"{s.serving_p99_ms:.2f} ms"
    return ""
