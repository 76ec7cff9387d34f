"""Admission's first checks, pure: the hard limits on what a header may declare
(broker/sched/limits.py), before any tensor is sized, and what each caller is owed
(broker/sched/owed.py, server.max_inflight_per_client)."""
from __future__ import annotations

import pytest

from tgw.broker.config.schema import ServerDecl
from tgw.broker.sched.limits import check_declared
from tgw.broker.sched.admission import Owed
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


def test_requests_owed_per_caller():
    owed = Owed(2)
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
