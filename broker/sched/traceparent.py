"""A request's W3C `traceparent` (docs/PROTOCOL.md 5.2), read at admission: a valid one becomes
the request's trace context; an invalid one is ignored, as W3C says (a new trace starts), and
counted in a log line at most once every 10 s."""
from __future__ import annotations

import re

from tgw.broker.state.complaints import Complaints

TRACEPARENT = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")
ignored = Complaints()  # invalid traceparents: counted (ignored.counts), logged at most once per 10 s


def check_traceparent(value: str) -> str | None:
    """`value` when it is a valid W3C traceparent (version 00, non-zero ids), else None."""
    if TRACEPARENT.fullmatch(value):
        return value
    ignored.note("ignored", "traceparent", f"invalid traceparent {value[:64]!r} ignored (W3C: a new trace starts)")
    return None
