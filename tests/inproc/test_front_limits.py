"""The clients' side in-process: the hard limits on a header, callers and what they are owed,
rate-limited complaints (injected clock), and the open-file budget."""
from __future__ import annotations

import logging
import sys

import pytest

import zmq

from tgw.broker.front.callers import Callers, fit_max_clients, headroom
from tgw.broker.state.complaints import INTERVAL_S, Complaints
from tgw.broker.sched.limits import check_declared
from tgw.broker.config.schema import ServerDecl
from tgw.shm.errors import Code, TgwError
from tgw.shm.wire import PROTOCOL_VERSION, Infer, TensorMeta


def infer(*shapes, dtype="float32") -> Infer:
    return Infer(v=PROTOCOL_VERSION, id=1, model="m",
                 inputs=[TensorMeta(name=f"t{i}", dtype=dtype, shape=list(s)) for i, s in enumerate(shapes)])


SERVER = ServerDecl(max_request_bytes=1 << 20, max_tensors_per_request=3, max_dims=4, max_elements=1000)


@pytest.mark.parametrize("msg, code, key", [
    (infer([1], [1], [1], [1]), Code.INVALID_ARGUMENT, "max_tensors_per_request"),
    (infer([1, 1, 1, 1, 1]), Code.INVALID_INPUT_SHAPE, "max_dims"),
    (infer([2, -1]), Code.INVALID_INPUT_SHAPE, "negative"),
    (infer([10, 101]), Code.PAYLOAD_TOO_LARGE, "max_elements"),
    (infer([1 << 40, 1 << 40]), Code.PAYLOAD_TOO_LARGE, "max_elements"),   # no overflow, no allocation
])
def test_limits_refuse_from_the_header_alone(msg, code, key):
    with pytest.raises(TgwError) as info:
        check_declared(msg, SERVER)
    assert info.value.code == code and key in info.value.message


def test_decoded_bytes_are_bounded_whatever_travels():
    """3 x 1000 float64 declare 24,000 bytes once decoded, over a 16,000-byte limit."""
    with pytest.raises(TgwError) as info:
        check_declared(infer(*[[1000]] * 3, dtype="float64"), ServerDecl(max_request_bytes=16_000))
    assert info.value.code == Code.PAYLOAD_TOO_LARGE and info.value.details["declared"] == 24_000


def test_declared_bytes_are_returned_within_the_limits():
    assert check_declared(infer([2, 3], [4], dtype="int16"), SERVER) == (6 + 4) * 2


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


def test_requests_owed_per_caller():
    owed = Callers(ServerDecl(max_inflight_per_client=2), 10, Clock()).owed   # admission's count (sched/owed.py)
    owed.owe(b"a")
    owed.owe(b"a")
    with pytest.raises(TgwError) as info:
        owed.check(b"a")
    assert info.value.details["reason"] == "client_inflight"
    owed.check(b"b")
    owed.paid(b"a")
    owed.check(b"a")
    owed.paid(b"a")
    owed.paid(b"unknown")   # never owed: nothing to pay, no error
    assert not owed.by_caller and owed.total() == 0


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
