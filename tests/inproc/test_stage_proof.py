"""A stage version proves itself at load (workers/stage_proof.py): real handler files written
here, loaded and warmed up as the worker's loader does (StageRunner + warm_up). An exception or
a wrong return fails the load with the handler's message and its file:line; good examples of
each kind reach the stage; a stage with no examples says so once."""
from __future__ import annotations

import base64
import logging
import sys
import textwrap

import pytest
import torch

from tgw.shm.wire import IOSpec, ModelSpec
from tgw.workers.stage_proof import StageProofError
from tgw.workers.stage_runner import StageRunner

HANDLERS = textwrap.dedent('''\
    import torch

    SEEN = []

    class Good:
        def __call__(self, batch):
            SEEN.append({k: batch[k] for k in ("text", "x")})
            return {"n": torch.tensor([[len(batch["text"][0])]], dtype=torch.int64)}

    class Raises:
        def __call__(self, batch):
            return {"n": undefined_name}

    class WrongDtype:
        def __call__(self, batch):
            return {"n": torch.zeros(1, 1)}

    class FailsRow:
        def __call__(self, batch):
            batch.fail(0, "not a word")
            return {"n": torch.zeros(1, 1, dtype=torch.int64)}
    ''')
INPUTS = [IOSpec(name="text", dtype="bytes", shape=[]), IOSpec(name="x", dtype="float32", shape=[-1])]
OUTPUTS = [IOSpec(name="n", dtype="int64", shape=[1])]


@pytest.fixture(scope="module")
def handler_file(tmp_path_factory):   # one file: a handler file's module is shared by its content
    folder = tmp_path_factory.mktemp("handlers")
    (folder / "handlers.py").write_text(HANDLERS)
    (folder / "cat.bin").write_bytes(b"\xff\xd8meow")
    return str(folder / "handlers.py")


def loaded(handler_file: str, cls: str, examples: list[dict], version: str = "1") -> StageRunner:
    spec = ModelSpec(name="s", version=version, path="", format="stage", handler=f"{handler_file}:{cls}",
                     device="cpu", inputs=INPUTS, outputs=OUTPUTS, warmup_inputs=examples)
    runner = StageRunner(spec, torch.device("cpu"))
    runner.warm_up()
    return runner


def line_of(handler_file: str, text: str) -> int:
    return next(i for i, line in enumerate(open(handler_file).read().splitlines(), 1) if text in line)


EXAMPLE = {"text": "hello", "x": [1.0, 2.0]}


def test_an_exception_on_an_example_fails_the_load_with_its_message_and_file_line(handler_file):
    with pytest.raises(StageProofError) as info:
        loaded(handler_file, "Raises", [EXAMPLE])
    text = str(info.value)
    assert "stage s version 1: warmup_inputs[0] raised NameError" in text and "undefined_name" in text, text
    assert f"{handler_file}:{line_of(handler_file, 'undefined_name')}" in text, text


def test_outputs_that_break_the_declaration_fail_the_load_naming_the_output_and_the_call(handler_file):
    with pytest.raises(StageProofError) as info:
        loaded(handler_file, "WrongDtype", [EXAMPLE])
    text = str(info.value)
    assert "output 'n' is float32, declared int64" in text, text
    assert f"returned by {handler_file}:{line_of(handler_file, 'class WrongDtype') + 1} (WrongDtype.__call__)" in text


def test_a_stage_failing_its_own_example_row_fails_the_load(handler_file):
    with pytest.raises(StageProofError, match="failed its own example: not a word"):
        loaded(handler_file, "FailsRow", [EXAMPLE])


def test_each_kind_of_example_value_reaches_the_stage_as_a_batch_does(handler_file):
    runner = loaded(handler_file, "Good", [EXAMPLE, {"text": {"base64": base64.b64encode(b"\x00\x01").decode()},
                                                     "x": "zeros"},
                                           {"text": {"file": "cat.bin"}, "x": [3.0]}])
    got = sys.modules[type(runner.module).__module__].SEEN
    assert [s["text"] for s in got] == [[b"hello"], [b"\x00\x01"], [b"\xff\xd8meow"]]
    assert [s["x"].tolist() for s in got] == [[[1.0, 2.0]], [[0.0]], [[3.0]]]
    assert all(s["x"].dtype == torch.float32 for s in got)


def test_a_missing_example_file_fails_the_load_by_name(handler_file):
    with pytest.raises(StageProofError, match="'nope.jpg' cannot be read from the handler's folder"):
        loaded(handler_file, "Good", [{"text": {"file": "nope.jpg"}, "x": [1.0]}])


def test_a_stage_with_no_examples_loads_and_says_so_once(handler_file, caplog):
    with caplog.at_level(logging.WARNING, logger="tgw.worker"):
        loaded(handler_file, "Raises", [], version="quiet")
        loaded(handler_file, "Raises", [], version="quiet")
    said = [r.getMessage() for r in caplog.records if "declares no warmup_inputs" in r.getMessage()]
    assert said == ["stage s version quiet declares no warmup_inputs: it serves without being tried first "
                    "(docs/STAGES.md, \"Warm-up inputs\")"], said
