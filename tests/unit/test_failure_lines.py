"""Failures told where and whose they are: torch's shape/size errors recognised as the caller's
(workers/caller_faults.py, real torch errors), a failed batch's WARNING line with its file:line
and the per-model rate limit (workers/failure_log.py, a fake clock), and the stage key
`warmup_inputs` checked by the config's schema."""
from __future__ import annotations

import logging
import traceback

import pytest
import torch

from tgw.broker.config.schema_models import ModelDecl
from tgw.shm.errors import Code
from tgw.shm.wire import Batch, Done, ErrorBody
from tgw.workers.caller_faults import rejected, torch_reason
from tgw.workers.failure_log import FailureLog


def raised(fn) -> BaseException:
    try:
        fn()
    except Exception as exc:   # noqa: BLE001 - the very error torch raises
        return exc
    raise AssertionError("did not raise")


class PairSum(torch.nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b


CALLERS = {
    "add": lambda: torch.zeros(1, 7) + torch.zeros(1, 5),
    "matmul": lambda: torch.nn.functional.linear(torch.zeros(1, 3), torch.zeros(4, 5)),
    "embedding": lambda: torch.nn.functional.embedding(torch.tensor([[9]]), torch.zeros(4, 2)),
    "view": lambda: torch.zeros(1, 7).view(2, 5),
    "cat": lambda: torch.cat([torch.zeros(1, 2), torch.zeros(2, 3)], dim=0),
    "scripted": lambda: torch.jit.script(PairSum())(torch.zeros(1, 7), torch.zeros(1, 5)),
}


@pytest.mark.parametrize("case", sorted(CALLERS))
def test_torch_shape_and_index_errors_are_the_callers(case):
    assert torch_reason(raised(CALLERS[case])) is not None, raised(CALLERS[case])


def test_a_models_own_faults_stay_its_own():
    for exc in (raised(lambda: 1 / 0), raised(lambda: torch.zeros(2).item()), ValueError("negative input"),
                RuntimeError("CUDA error: an illegal memory access"), MemoryError()):
        assert torch_reason(exc) is None, exc


def test_a_rejection_names_the_model_and_each_inputs_shape():
    err = rejected("bert:1", ["input_ids", "attention_mask"], [[1, 7], [1, 5]], raised(CALLERS["scripted"]))
    assert err.code is Code.INVALID_ARGUMENT and err.details["reason"] == "inputs_rejected_by_model"
    assert err.message.startswith("model bert:1 rejected its inputs (input_ids [1, 7], attention_mask [1, 5]): "
                                  "The size of tensor a (7) must match the size of tensor b (5)"), err.message


def batch(batch_id: int, model: str = "m") -> Batch:
    return Batch(batch_id=batch_id, model=model, version="1", rows=2, block=0, inputs=[], splits=[1, 1],
                 ids=[40 + batch_id, 41 + batch_id])


def failed_done(batch_id: int) -> Done:
    return Done(batch_id=batch_id, error=ErrorBody(code="MODEL_EXECUTION_ERROR", message="ValueError: bad"))


def test_a_failed_batch_is_one_line_with_the_exception_and_its_file_line(caplog):
    log = FailureLog()
    exc = raised(lambda: int("x"))
    log.note(7, exc)
    with caplog.at_level(logging.WARNING, logger="tgw.worker"):
        log.batch(batch(7), failed_done(7))
        log.batch(batch(8), Done(batch_id=8))   # answered: no line
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    here = f"{__file__}:{traceback.extract_tb(exc.__traceback__)[-1].lineno})"   # the lambda's line: the innermost
    assert lines[0].startswith("m:1 failed MODEL_EXECUTION_ERROR: batch 7, 2 of 2 request(s) (ids 47 48), 2 row(s): "
                               "ValueError: invalid literal for int() with base 10: 'x' (at "), lines[0]
    assert lines[0].endswith(here), lines[0]
    assert caplog.records[0].event == "batch_failed" and caplog.records[0].code == "MODEL_EXECUTION_ERROR"
    assert caplog.records[0].request_ids == [47, 48]


def test_requests_a_stage_failed_are_named_by_their_ids(caplog):
    row_failed = ErrorBody(code="INVALID_ARGUMENT", message="stage s: not UTF-8")
    with caplog.at_level(logging.WARNING, logger="tgw.worker"):
        FailureLog().batch(batch(3), Done(batch_id=3, failed={1: row_failed}))
    assert caplog.records[0].getMessage() == ("m:1 failed INVALID_ARGUMENT: batch 3, 1 of 2 request(s) (ids 44), "
                                              "2 row(s): stage s: not UTF-8")


class NegativeFails(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool(x[0, 0] < 0):
            raise ValueError("negative input rejected by model")
        return x + 1


def test_a_torchscript_models_failure_is_told_by_its_own_line(caplog):
    log = FailureLog()
    exc = raised(lambda: torch.jit.script(NegativeFails())(-torch.ones(1, 2)))
    log.note(5, exc.with_traceback(None))   # in a worker its Python frames are tgw's and torch's only
    with caplog.at_level(logging.WARNING, logger="tgw.worker"):
        log.batch(batch(5), failed_done(5))
    raise_line = next(i for i, line in enumerate(open(__file__).read().splitlines(), 1)
                      if line.strip() == 'raise ValueError("negative input rejected by model")')
    assert caplog.records[0].getMessage().endswith(
        f"2 row(s): Error: builtins.ValueError: negative input rejected by model (at {__file__}:{raise_line})"), \
        caplog.records[0].getMessage()


def test_a_storm_is_rate_limited_per_model_and_the_next_line_counts_what_was_left_out(caplog):
    now = [100.0]
    log = FailureLog(lines_per_s=5, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="tgw.worker"):
        for i in range(50):
            log.batch(batch(i), failed_done(i))
        log.batch(batch(99, model="other"), failed_done(99))   # another model has its own budget
        now[0] += 1.0
        log.batch(batch(100), failed_done(100))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 7, lines
    assert lines[5].startswith("other:1 failed")
    assert lines[6].endswith("(45 more failure line(s) of m:1 left out)") and caplog.records[6].left_out == 45


STAGE = {"name": "s", "versions": [{"version": "1", "handler": "s.py:S"}],
         "inputs": [{"name": "text", "dtype": "bytes", "shape": []}, {"name": "ids", "dtype": "int64", "shape": [-1]},
                    {"name": "box", "dtype": "float32", "shape": [2, 2]}],
         "outputs": [{"name": "y", "dtype": "float32", "shape": [1]}]}


def test_warmup_inputs_take_each_kind_of_value():
    good = [{"text": "hi", "ids": [1, 2, 3], "box": [[0, 1], [2.5, 3]]},
            {"text": {"base64": "AAE="}, "ids": "zeros", "box": "zeros"}, {"text": {"file": "cat.jpg"}, "ids": [],
                                                                          "box": [[0, 0], [0, 0]]}]
    assert ModelDecl(**STAGE, warmup_inputs=good).warmup_inputs == good


@pytest.mark.parametrize("example, words", [
    ({"text": "hi", "ids": [1]}, "names inputs ['ids', 'text']; the stage's inputs are ['text', 'ids', 'box']"),
    ({"text": "hi", "ids": [1.5], "box": "zeros"}, "input 'ids': element [0] is 1.5, not a int64 value"),
    ({"text": "hi", "ids": [1], "box": [[0, 1]]}, "input 'box': the value is 1 items; declared shape [2, 2]"),
    ({"text": "zeros", "ids": [1], "box": "zeros"}, None),   # a bytes input's "zeros" is the string itself
    ({"text": {"file": "../etc/passwd"}, "ids": [1], "box": "zeros"}, "without '..'"),
    ({"text": 5, "ids": [1], "box": "zeros"}, "a bytes element is a string"),
])
def test_bad_warmup_inputs_are_refused_by_key_and_input(example, words):
    if words is None:
        ModelDecl(**STAGE, warmup_inputs=[example])
        return
    with pytest.raises(ValueError) as info:
        ModelDecl(**STAGE, warmup_inputs=[example])
    assert "warmup_inputs[0]: " in str(info.value) and words in str(info.value), str(info.value)


def test_warmup_inputs_are_a_stages_key():
    model = {**STAGE, "versions": [{"version": "1", "path": "m.pt"}],
             "inputs": [{"name": "x", "dtype": "float32", "shape": [2]}]}
    with pytest.raises(ValueError, match="warmup_inputs are a stage's keys"):
        ModelDecl(**model, warmup_inputs=[{"x": [1, 2]}])
