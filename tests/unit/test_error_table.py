"""The error table (shm/errors.py): every code's HTTP status and retryability, one exception
class per code (the client exports the same), and what an unknown code from a newer server becomes."""
from __future__ import annotations

import pytest

import tgw.client
from tgw.shm import errors
from tgw.shm.errors import ERROR_CLASSES, ERROR_TABLE, Code, TgwError, error_from_body, fail, http_status
from tgw.shm.wire import PROTOCOL_VERSION as V, ErrorBody, ErrorReply, encode, reply_decoder


EXPECTED = {
    "INVALID_ARGUMENT": 400, "INVALID_INPUT_SHAPE": 400, "INVALID_INPUT_DTYPE": 400, "PAYLOAD_TOO_LARGE": 413,
    "UNAUTHENTICATED": 401, "MODEL_NOT_FOUND": 404, "VERSION_NOT_FOUND": 404, "JOB_NOT_FOUND": 404, "MODEL_NOT_READY": 503,
    "RATE_LIMITED": 429, "OVERLOADED": 429, "DEADLINE_EXCEEDED": 504, "CIRCUIT_OPEN": 503,
    "OUT_OF_GPU_MEMORY": 507, "OUT_OF_SHM": 507, "WORKER_DIED": 503, "MODEL_EXECUTION_ERROR": 500,
    "INTERNAL": 500,
    "UNAVAILABLE": 503,   # the client's own: the connection to the broker was lost
}


def test_error_table_matches_design():
    assert {c.value for c in Code} == set(EXPECTED)
    assert set(ERROR_TABLE) == set(Code)
    for name, status in EXPECTED.items():
        assert ERROR_TABLE[Code(name)][0] == status, name
        assert http_status(name) == status
        assert http_status(Code(name)) == status


def test_retryable_codes():
    assert ERROR_TABLE[Code.WORKER_DIED][1] is True
    assert fail(Code.WORKER_DIED, "gone").retryable
    for code in ("INVALID_ARGUMENT", "INVALID_INPUT_SHAPE", "INVALID_INPUT_DTYPE", "PAYLOAD_TOO_LARGE",
                 "MODEL_NOT_FOUND", "VERSION_NOT_FOUND", "MODEL_EXECUTION_ERROR"):
        assert not ERROR_TABLE[Code(code)][1], code


def test_exception_classes_are_written_out_one_per_code():
    """Each code has exactly one class, defined in shm/errors.py under the name its code spells."""
    source = open(errors.__file__).read()
    classes = TgwError.__subclasses__()
    assert sorted(c.code.value for c in classes) == sorted(c.value for c in Code)
    for cls in classes:
        spelled = "".join(p.capitalize() for p in cls.code.value.split("_"))
        assert cls.__name__ == (spelled if spelled.endswith("Error") else spelled + "Error")   # "Error" once
        assert f"class {cls.__name__}(TgwError):\n    code = Code.{cls.code.value}\n" in source
        assert ERROR_CLASSES[cls.code] is cls


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fail_gives_subclass(name):
    e = fail(name, "msg", k=1)
    cls = ERROR_CLASSES[Code(name)]
    assert type(e) is cls and isinstance(e, TgwError)
    assert e.code == Code(name) and e.message == "msg" and e.details == {"k": 1}
    assert e.http_status == EXPECTED[name]
    assert str(e) == f"{name}: msg"
    assert getattr(tgw.client, cls.__name__) is cls       # the client exports the same classes
    assert getattr(errors, cls.__name__) is cls
    assert fail(Code(name), "m").code == Code(name)
    back = error_from_body(reply_decoder.decode(encode(ErrorReply(v=V, id=1, error=e.to_body()))).error)
    assert type(back) is cls and back.message == "msg" and back.details == {"k": 1}
    assert e.to_body().retryable == e.retryable


def test_client_exception_names():
    assert tgw.client.ModelNotFoundError is ERROR_CLASSES[Code.MODEL_NOT_FOUND]
    assert isinstance(fail("MODEL_NOT_FOUND", "x"), tgw.client.ModelNotFoundError)
    assert isinstance(fail("OUT_OF_GPU_MEMORY", "x"), tgw.client.OutOfGpuMemoryError)
    assert issubclass(tgw.client.WorkerDiedError, tgw.client.TgwError)
    assert tgw.client.TgwError is TgwError


@pytest.mark.parametrize("code", ["SOMETHING_NEW", ""])
def test_unknown_code_gives_tgw_error(code):
    e = error_from_body(ErrorBody(code=code, message="from a newer server", details={"a": 1}))
    assert type(e) is TgwError
    assert e.code == Code.INTERNAL
    assert e.details["unknown_code"] == code and e.details["a"] == 1
    assert e.message == "from a newer server"


def test_tgw_error_defaults():
    e = TgwError("plain")
    assert e.code == Code.INTERNAL and e.details == {} and e.http_status == 500 and not e.retryable
    with pytest.raises(ValueError):
        fail("NOT_A_CODE", "x")


def test_model_execution_error_keeps_its_old_name():
    """Renamed from ModelExecutionErrorError (issue 39): the old name is the same class, exported."""
    assert tgw.client.ModelExecutionError is tgw.client.ModelExecutionErrorError is errors.ModelExecutionError
    assert {"ModelExecutionError", "ModelExecutionErrorError"} <= set(tgw.client.__all__)
    assert fail("MODEL_EXECUTION_ERROR", "boom").__class__.__name__ == "ModelExecutionError"
    assert not [n for n in tgw.client.__all__ if n.endswith("ErrorError") and n != "ModelExecutionErrorError"]
