"""The clients' side in-process: connected callers, rate-limited complaints (injected clock), the
open-file budget and a malformed header. Admission's own checks, the header's hard limits and what
each caller is owed, are tests/unit/test_admission_limits.py's."""
from __future__ import annotations

import logging
import sys

import pytest

import zmq

from tgw.broker.front.callers import Callers, fit_max_clients, headroom
from tgw.broker.state.complaints import INTERVAL_S, Complaints
from tgw.broker.config.schema import ServerDecl
from tgw.shm.errors import Code, TgwError


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_complaints_count_everything_and_log_once_per_kind_per_interval(caplog):
    clock = Clock()
    c = Complaints(clock)
    with caplog.at_level(logging.WARNING, logger="tgw.broker"):
        for _ in range(500):
            c.note("refused", "malformed_header", "bad header")
        c.note("refused", "unauthenticated", "no token")
        clock.now = INTERVAL_S
        c.note("refused", "malformed_header", "bad header")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and "and 499 more like it" in lines[-1]
    assert c.as_dict()["refused"] == {"malformed_header": 501, "unauthenticated": 1}


def event(kind: int) -> list:
    return [kind.to_bytes(2, "little") + (0).to_bytes(4, "little"), b"ipc://x"]


def test_callers_past_max_clients_are_refused_then_denied_and_let_in_once_room_is_back():
    callers = Callers(ServerDecl(max_clients=2, max_inflight_per_client=2), 2, Clock())
    for _ in range(2):
        callers.on_monitor(event(zmq.EVENT_ACCEPTED))
    callers.let_in(b"a")  # judged on the count when it first speaks: 2 of 2
    callers.on_monitor(event(zmq.EVENT_ACCEPTED))
    with pytest.raises(TgwError) as info:
        callers.let_in(b"new")
    assert info.value.code == Code.OVERLOADED and info.value.details["reason"] == "too_many_clients"
    callers.let_in(b"a")  # served before: always let in
    zap = [b"id", b"", b"1.0", b"7", b"tgw", b"addr", b"", b"NULL"]
    assert callers.zap(zap)[4] == b"200"
    for _ in range(headroom(2)):
        callers.on_monitor(event(zmq.EVENT_ACCEPTED))
    assert callers.zap(zap)[3:5] == [b"7", b"400"] and callers.denied == 1
    for _ in range(3 + headroom(2) - 2):
        callers.on_monitor(event(zmq.EVENT_DISCONNECTED))
    callers.let_in(b"new")


def test_max_clients_shrinks_to_fit_the_open_file_limit(caplog):
    assert fit_max_clients(100, 65536, 8) == 100
    fits = fit_max_clients(1000, 1024, 2)
    assert fits < 1000 and fits + headroom(fits) + 128 + 16 <= 1024
    assert "does not fit the open-file limit" in caplog.text


def test_a_deeply_nested_header_is_refused_as_malformed_not_a_crash():
    """msgspec recurses per nesting level: 1,000 nested maps (3 KB) once escaped as RecursionError,
    unanswered and with a traceback (found by scripts/fuzz.sh)."""
    import msgspec

    from tgw.broker.front.frontdoor import Refused, read_request
    deep = msgspec.Raw(b"\x81\xa1a" * 1000 + b"\x80")   # {"a": {"a": ... {}}}, 1,000 deep
    # the broker never imports torch and runs at Python's default limit; torch.export and
    # inductor, imported by other tests of this process, raise it
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    try:
        for field in ("extra", "model", "id", "v"):
            header = msgspec.msgpack.encode({"op": "health", "v": 1, "id": 5, field: deep})
            with pytest.raises(Refused) as info:
                read_request([zmq.Frame(b"caller"), zmq.Frame(header)], ServerDecl())
            assert info.value.error.code == Code.INVALID_ARGUMENT and info.value.kind == "malformed_header"
    finally:
        sys.setrecursionlimit(limit)
