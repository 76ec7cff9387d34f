"""A failed load's short text (workers/load_errors.py): what failed in one line, then the likely
cause and the fix for the failures tgw knows; and the modules a torch.export archive needs
preloaded, read without torch (broker/config/export_types.py)."""
from __future__ import annotations

import json
import zipfile

from tgw.broker.config.export_types import missing_preloads, needed_modules
from tgw.shm.model_format import ModelFormatError
from tgw.workers.load_errors import error_text


def raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:
        return caught


def test_a_torchscript_error_is_told_by_its_last_line():
    script = RuntimeError("The following operation failed in the TorchScript interpreter.\n"
                          "Traceback of TorchScript (most recent call last):\n" + "  File \"code.py\", line 1\n" * 40
                          + "RuntimeError: mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)")
    text = error_text(raised(script))
    assert text == "RuntimeError: mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5) (+42 line(s) in the worker's log)"


def test_known_causes_name_the_fix():
    cases = {
        FileNotFoundError(2, "No such file or directory"): "check the version's path",
        RuntimeError("PytorchStreamReader failed reading zip archive: failed finding central directory"):
            "set the version's format:",
        ModelFormatError("m.pt is declared format: export but is a TorchScript program"): "set the version's format:",
        RuntimeError("version_ <= kMaxSupportedFileFormatVersion INTERNAL ASSERT FAILED: Attempted to read a PyTorch "
                     "file with version 10, but the maximum supported version for reading is 9."):
            "save it again with the worker's torch version",
        RuntimeError("Could not find schema for myops::fused_gelu"): "registers the myops operators to workers.preload",
        RuntimeError("Unknown builtin op: tour::scale."): "the tour operators",
    }
    for exc, fix in cases.items():
        lines = error_text(raised(exc)).splitlines()
        assert len(lines) == 3 and lines[1].startswith("cause: ") and lines[2].startswith("fix: "), lines
        assert fix in lines[2], lines
        assert "., which" not in lines[1], lines   # an operator named without the sentence's full stop


def test_a_missing_pytree_type_names_the_module_to_preload():
    inner = raised(NotImplementedError("Deserializing transformers.modeling_outputs.SequenceClassifierOutput "
                                       "in pytree is not registered."))
    outer = RuntimeError("We ran into an error when deserializing the saved file. Please check the warnings above")
    outer.__context__ = inner
    assert error_text(outer).splitlines()[2] == \
        "fix: add it to the worker's imports: workers.preload: [transformers.modeling_outputs]"


def test_an_unknown_failure_is_its_message():
    assert error_text(raised(ValueError("bad things"))) == "ValueError: bad things"
    two = "input 'x' batch dim allows 1..8\n[16] fall outside"   # a short message is told whole
    assert error_text(raised(ValueError(two))) == f"ValueError: {two}"


def pt2(path, out_type: str) -> str:
    """A minimal archive as torch.export.save lays it out: models/model.json with pytree specs."""
    spec = json.dumps([1, {"type": out_type, "context": "[]", "children_spec": [
        {"type": "builtins.tuple", "context": "null", "children_spec": []}]}])
    model = {"graph_module": {"module_call_graph": [{"fqn": "", "signature": {
        "in_spec": json.dumps([1, {"type": "builtins.tuple", "context": "null", "children_spec": []}]),
        "out_spec": spec}}]}}
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("m/models/model.json", json.dumps(model))
    return str(path)


def test_export_archive_modules(tmp_path):
    hf = pt2(tmp_path / "hf.pt2", "transformers.modeling_outputs.SequenceClassifierOutput")
    assert needed_modules(hf) == ["transformers.modeling_outputs"]
    assert needed_modules(pt2(tmp_path / "plain.pt2", "collections.OrderedDict")) == []
    assert needed_modules(pt2(tmp_path / "torchs.pt2", "torch.fx.immutable_collections.immutable_list")) == []
    assert needed_modules(str(tmp_path / "absent.pt2")) == []   # the load's to judge
    (line,) = missing_preloads(hf, [])
    assert "needs the types of module transformers.modeling_outputs" in line
    assert "workers.preload: [transformers.modeling_outputs]" in line
    assert missing_preloads(hf, ["transformers.modeling_outputs"]) == []


def test_a_declaration_the_program_cannot_serve_carries_its_own_fix():
    """A FormatMismatch names the dim and the export that fixes it: no cause line about another format."""
    from tgw.workers.formats import FormatMismatch
    said = ("m.onnx cannot serve m:1 as declared: input 'x' has a static batch dim of 2 in the model, but the broker "
            "batches 1..8 rows (max_batch_size): export it with a dynamic batch dim")
    assert error_text(raised(FormatMismatch(said))) == f"FormatMismatch: {said}"
